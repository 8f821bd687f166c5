"""Fit gemm.WGMMA_COST_PER_STAGE / WGMMA_COST_TERMS (the tall-tile cost model, route above M = 256 since session 44)
to probe_configs logs that time the tall tiles (wgmma-n{160,192,256}-...-p2, whole and -sk), routeT0 and the routes
per (shape, M), e.g. stages s43d and s44a (the fit in gemm.py):

    python benchmarks/fit_tall_cost.py benchmarks/logs/s43d.log benchmarks/logs/s44a.log

(--all-m: also the cells at M <= 256, e.g. s44c's or s45a's, for a model over all of M = 129-1024. --extra-tiles
176-1-6,208-1-6,...: tall tiles the log's probe built with --extra-wgmma NT-FW-S-p2, e.g. stage s48a's.)

--clustered LOG: a log measured with session 45's cluster sum (K splits of two launched as clusters, e.g. s45d or
the prepared s46a; not s45c, whose route took clusters of every size): its launches get the cluster the rule
(gemm.wgmma_cluster_sum, with the H200's max active clusters measured in s45g) gives them, `NAME+ws` configs none,
and the fit gains a `cluster` term (the clustered split's fix-up against the workspace one). Explicit K splits in
config names (wgmma-n192-f1-s6-k2-p2) are read. --fixup-rows: fix-up terms scaled by the tile's rows (gemm.WGMMA_COST_FIXUP_ROWS). --route48 LOG: a clustered log whose `route` ran session 48's first
fit (s48d); its routeC47 (session 47's model) is the route its held-out cells compare against. Only fp16 4-bit lines
are read.

Route names in the logs: routeT0 the route without tall tiles; routeCM the cost model (s44a, session 43's
coefficients); route in a cell that also has routeCM (s44a) the table's rows; other `route` timings (s43d) are
skipped, their rows changed since. `routeTab` (later logs) is the table's rows; a later log's `route` is not read.

Needs numpy. Runs on the CPU (the launches the route would make are computed with a 132-SM H200 stand-in). Prints the
coefficients, the in-sample error, and a leave-one-shape-out check of the cost model's pick against the fastest
measured launch of each cell and against the `route` timing of that cell."""
import collections
import functools
import re
import sys

import numpy as np
from jitmarlin.ops import gemm as G, _kernels as K
from probe_configs import S47_FIT_PER_STAGE, S47_FIT_TERMS  # (this directory: session 47's model, config routeC47)
from jitmarlin.jit import driver


class _Dev:
    sm_count = 132


driver.device = lambda index: _Dev()
G._cc = functools.lru_cache(None)(lambda index: (9, 0))
class _Fn:  # the H200's clusters at once (s45g): 2 / 3 / 4 CTAs, forms of two CTAs per SM (256 threads) or one
    def max_active_clusters(self, threads, smem, cluster):
        return {2: 132, 3: 79, 4: 62}[cluster] if threads == 256 else {2: 66, 3: 39, 4: 30}[cluster]


K.get_wgmma_kernel = lambda *a, **k: _Fn()
G.WGMMA_CLUSTER_HALVE = False  # the routes in these logs ran before session 46's halving rule
fam = K.Family("f16", 4, False, 128)
pat = re.compile(r"^\[(\S+)\] (\S+) u(\d+) (\d+x\d+) M=(\d+) (\S+): ([\d.]+) us")
ALL_M = "--all-m" in sys.argv  # also fit the cells below M = 257 (where the table's rows route)
# --fixup-rows: the K-split / stream-K / cluster fix-up terms times the tile's rows / 128 (NT x FW / 128: the fp32
# partial sums a fix-up moves), as gemm.wgmma_cost_us prices them with WGMMA_COST_FIXUP_ROWS (session 48, prepared)
FIXUP_ROWS = "--fixup-rows" in sys.argv
MIN_M = 257
args = [a for a in sys.argv[1:] if a not in ("--all-m", "--fixup-rows")]
if "--extra-tiles" in args:  # tall tiles a log's probe built beyond K.WGMMA_PROD2_CONFIGS, e.g. 176-1-6,208-1-6
    i = args.index("--extra-tiles")
    K.WGMMA_PROD2_CONFIGS += tuple(tuple(int(x) for x in t.split("-")) for t in args[i + 1].split(","))
    del args[i:i + 2]
OPTS = ("--clustered", "--route48")
clustered_logs = {args[i + 1] for i, a in enumerate(args) if a in OPTS}
route48_logs = {args[i + 1] for i, a in enumerate(args) if a == "--route48"}
logs = [a for i, a in enumerate(args) if a not in OPTS and (i == 0 or args[i - 1] not in OPTS)]
data = collections.defaultdict(list)
for path in logs + sorted(clustered_logs) if logs or clustered_logs else ["benchmarks/logs/s43d.log"]:
    tag = "@cl" if path in clustered_logs else ""  # launches of a clustered log: names NAME@cl
    for line in open(path):
        m = pat.match(line.strip())
        if m:
            _, dt, b, shape, M, cfg, us = m.groups(); k, n = map(int, shape.split("x"))
            if dt != "f16" or b != "4":
                continue  # (the model is fitted to fp16 4-bit g128 timings)
            if cfg == "route" and path in route48_logs:
                cfg = "routeC48"  # --route48 LOG (clustered): its route ran session 48's first fit (s48d)
            data[(k, n, int(M), cfg + tag)].append(float(us))
SMS = 132
# the coefficients s44a's routeCM ran with (session 43, fitted to s43d alone)
S43_PER_STAGE = {(128, 1, "plain"): 0.767, (128, 2, "p2"): 0.813, (128, 2, "w"): 0.864,
                 (160, 2, "p2"): 0.965, (192, 1, "p2"): 0.587, (256, 1, "p2"): 0.755}
S43_TERMS = {"a": 1.359, "split": 2.148, "per_split": 3.526, "sk": 14.961, "sk_stage": 0.049}
# later models whose launches logs name: routeC47 (session 47's), routeC48 (session 48's first
# fit with the 176- / 208- / 224- / 240-token tiles: the route of --route48 logs)
MODELS = {"routeCM": (S43_PER_STAGE, dict(S43_TERMS, cluster=0.0)),
          "routeC47": (S47_FIT_PER_STAGE, S47_FIT_TERMS),
          "routeC48": ({(128, 1, "plain"): 0.777, (128, 2, "p2"): 0.826, (128, 2, "w"): 0.858, (144, 1, "p2"): 0.504,
                        (160, 2, "p2"): 0.962, (176, 1, "p2"): 0.566, (192, 1, "p2"): 0.589, (208, 1, "p2"): 0.637,
                        (224, 1, "p2"): 0.659, (240, 1, "p2"): 0.705, (256, 1, "p2"): 0.762},
                       {"a": -0.275, "split": 4.135, "per_split": 2.721, "sk": 15.476, "sk_stage": 0.04, "cluster": -2.259})}
def launch_of(m, n, k, cfg):
    clustered = cfg.endswith("@cl")
    cfg = cfg[:-3] if clustered else cfg
    ws = cfg.endswith("+ws")
    cfg = cfg[:-3] if ws else cfg
    G.WGMMA_CLUSTER_SUM = clustered and not ws  # the launches of logs before session 45 had no clusters
    G.wgmma_launch.cache_clear()
    if cfg.startswith("wgmma"):
        p = cfg.split("-"); nt, fw, st = int(p[1][1:]), int(p[2][1:]), int(p[3][1:]); sk = "sk" in p
        if (nt, fw, st) not in K.WGMMA_PROD2_CONFIGS or not cfg.endswith("-p2"):
            return None  # an extra ring depth (e.g. s44c's) or a plain 128-token config: not in the fit
        cls = (nt, fw, "p2")
        per_sm = 1
        given = [int(x[1:]) for x in p[4:] if x[0] == "k" and x[1:].isdigit()]
        # the launch probe_configs made of it (its K splits, stream-K where it says, its cluster)
        wl = G.wgmma_launch(m, n, k, fam, 0, nt, fw, st, -1 if sk else given[0] if given else None, False, 2)
        splits, cluster = wl.splits, wl.cluster
    else:
        # routeT0: the route without tall tiles; route (s44a) / routeTab: the table's tall tiles; routeCM: the model
        # with session 43's coefficients
        G.WGMMA_TALL_MAX_M = 0 if cfg == "routeT0" else 1024
        G.WGMMA_TALL_MODEL = cfg in MODELS; G.wgmma_launch.cache_clear()
        saved = dict(G.WGMMA_COST_PER_STAGE), dict(G.WGMMA_COST_TERMS)
        # (replaced, not updated: the shipped model prices tiles and terms session 43's had not)
        G.WGMMA_COST_PER_STAGE.clear(); G.WGMMA_COST_TERMS.clear()
        G.WGMMA_COST_PER_STAGE.update(MODELS.get(cfg, MODELS["routeCM"])[0])
        G.WGMMA_COST_TERMS.update(MODELS.get(cfg, MODELS["routeCM"])[1])
        wl = G.wgmma_launch(m, n, k, fam, 0)
        G.WGMMA_COST_PER_STAGE.clear(); G.WGMMA_COST_TERMS.clear()
        G.WGMMA_COST_PER_STAGE.update(saved[0]); G.WGMMA_COST_TERMS.update(saved[1])
        G.WGMMA_TALL_MAX_M, G.WGMMA_TALL_MODEL = 1024, True
        G.wgmma_launch.cache_clear()
        nt, fw, splits, cluster = wl.nt, wl.fw, wl.splits, wl.cluster
        wide = wl.threads == 512
        cls = (nt, fw, "p2" if wl.prod == 2 else "p" if wl.prod else "w" if wide else "plain")
        per_sm = 1 if wl.prod == 2 else G.wgmma_ctas_per_sm(fw, (nt, fw, wl.stages) if wl.prod else None, 4)
        if wide: fw = 2  # four warpgroups of one strip: a 256-feature tile
    return cls, G.wgmma_cost_stages(m, n, k, (nt, fw, cls[2]), splits, SMS * per_sm), splits, 1 if cluster else 0
rows = []
for (k, n, M, cfg), v in data.items():
    if cfg == "route" and (k, n, M, "routeCM") not in data: continue  # s43d's / a later log's route: not read
    launch = launch_of(M, n, k, cfg)
    if launch is None or (M < MIN_M and not ALL_M):
        continue
    cls, st, sp, cl = launch
    rows.append(((k, n, M), cfg, cls, st, sp, cl, min(v)))
classes = sorted({r[2] for r in rows}, key=str)
with_cluster = any(r[5] for r in rows)  # the cluster term only where some launch took a cluster
print(classes, "clustered launches:", sum(r[5] for r in rows))
def feats(cls, st, sp, cl):
    f = [0.0] * len(classes); f[classes.index(cls)] = st
    r = cls[0] * cls[1] / 128 if FIXUP_ROWS else 1.0
    f += [1.0, r if sp > 1 else 0.0, sp * r if sp > 1 else 0.0, r if sp == -1 else 0.0, st if sp == -1 else 0.0]
    return f + ([float(cl) * r] if with_cluster else [])
X = np.array([feats(*r[2:6]) for r in rows]); y = np.array([r[6] for r in rows]); w = 1 / y
def fit(idx):
    cf, *_ = np.linalg.lstsq(X[idx] * w[idx, None], y[idx] * w[idx], rcond=None); return cf
cf = fit(np.arange(len(rows)))
print({str(c): round(v, 3) for c, v in zip(classes + ["a", "split", "per_split", "sk", "sk*st"]
                                            + (["cluster"] if with_cluster else []), cf)})
rel = X @ cf / y - 1
print("in-sample rel err median %.3f 90%% %.3f" % (np.median(abs(rel)), np.quantile(abs(rel), .9)))
shapes = sorted({r[0][:2] for r in rows})
out = []
for hold in shapes:
    tr = np.array([i for i, r in enumerate(rows) if r[0][:2] != hold])
    c2 = fit(tr); pr = X @ c2
    cells = collections.defaultdict(list)
    for i, r in enumerate(rows):
        if r[0][:2] == hold: cells[r[0]].append((pr[i], r[6], r[1]))
    for key, lst in cells.items():
        best = min(x[1] for x in lst); pick = min(lst)
        route = min(data.get(key + ("routeTab",)) or data.get(key + ("route",)) or data.get(key + ("route@cl",))
                    or data[key + ("routeC47@cl",)])  # (--route48 logs: session 47's route, the one replaced)
        out.append((pick[1] / best - 1, route / best - 1, pick[1] / route, key, pick[2]))
a = np.array([o[:3] for o in out])
print("held-out: model loss mean %.3f (>5%%: %d), route loss mean %.3f (>5%%: %d); model/route geo %.3f; worse>5%% %d better>5%% %d of %d" % (
    a[:, 0].mean(), (a[:, 0] > .05).sum(), a[:, 1].mean(), (a[:, 1] > .05).sum(), np.exp(np.log(a[:, 2]).mean()), (a[:, 2] > 1.05).sum(), (a[:, 2] < .95).sum(), len(a)))
for o in sorted(out, key=lambda o: -o[2])[:10]: print("  worst", o[3], o[4], "model/route %.2f" % o[2])

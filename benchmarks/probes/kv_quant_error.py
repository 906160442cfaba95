"""Per-layer attention-output error of fake-quantized K/V on captured real (q, k, v)."""

import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from kvstate._quant_codec import Codec

path = sys.argv[1]
d = np.load(path)
L = len([k for k in d.files if k.startswith("q")])


def fq(x, bits, group, rot):  # x (1,H,T,D) fp32 -> dequantized
    if bits >= 16:
        return x
    c = Codec(bits, group, 0, rot, 0)
    return np.array(c.decode(c.encode(mx.array(x))))


def fq_channel(x, bits, group):  # per-channel: groups of `group` tokens along T
    T = x.shape[2]
    pad = -T % group
    xt = np.swapaxes(x, 2, 3)
    xt = np.pad(xt, [(0, 0), (0, 0), (0, 0), (0, pad)], mode="edge")
    y = np.array(
        mx.dequantize(
            *mx.quantize(mx.array(xt), group_size=group, bits=bits), group_size=group, bits=bits
        )
    )
    return np.swapaxes(y[..., :T], 2, 3)


def attend(q, kq, v_q, k, v, s, sink=0, recent=0):
    H, T = q.shape[1], q.shape[2]
    rep = H // k.shape[1]
    kq_, k_ = np.repeat(kq, rep, 1), np.repeat(k, rep, 1)
    vq_, v_ = np.repeat(v_q, rep, 1), np.repeat(v, rep, 1)
    i = np.arange(T)[:, None]
    j = np.arange(T)[None]
    exact = (j < sink) | (j > i - recent)  # positions kept in full precision
    sc = np.where(exact, q @ np.swapaxes(k_, -1, -2), q @ np.swapaxes(kq_, -1, -2)) * s
    sc = np.where(j <= i, sc, -np.inf)
    w = np.exp(sc - sc.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return (w * exact) @ v_ + (w * ~exact) @ vq_


def ref(q, k, v, s):
    return attend(q, k, v, k, v, s)


OPTIONS = {}
for spec in sys.argv[2].split(";"):
    OPTIONS[spec] = spec


def parse(spec):
    o = dict(kb=4, vb=3, kg=64, vg=64, rot="none", sink=0, recent=0, kchan=0)
    w = spec.split()
    kb, vb = w[0].upper().removeprefix("K").split("/V")
    o["kb"], o["vb"] = int(kb), int(vb)
    for x in w[1:]:
        if x in ("hadamard", "so4"):
            o["rot"] = x
        elif x.startswith("kg"):
            o["kg"] = int(x[2:])
        elif x.startswith("vg"):
            o["vg"] = int(x[2:])
        elif x.startswith("g"):
            o["kg"] = o["vg"] = int(x[1:])
        elif x.startswith("sink"):
            o["sink"] = int(x[4:])
        elif x.startswith("recent"):
            o["recent"] = int(x[6:])
        elif x.startswith("kchan"):
            o["kchan"] = int(x[5:])
        elif x.startswith("center"):
            o["center"] = int(x[6:])
        elif x.startswith("cscale"):
            o["cscale"] = int(x[6:])
    return o


glob = [i for i in range(L) if (i + 1) % 6 == 0] if L == 18 else []
refs = {}
for i in range(L):
    q, k, v, s = d[f"q{i}"], d[f"k{i}"], d[f"v{i}"], float(d[f"s{i}"])
    refs[i] = ref(q, k, v, s)
print(
    f"{path}: {L} layers, T={d['q0'].shape[2]}; rel. L2 error of attention outputs (mean over layers; global / window layers)"
)
print("| option | all | global | window | worst layer |")
print("|---|---|---|---|---|")
for spec in OPTIONS:
    o = parse(spec)
    errs = []
    for i in range(L):
        q, k, v, s = d[f"q{i}"], d[f"k{i}"], d[f"v{i}"], float(d[f"s{i}"])
        kk = k
        if o.get("center"):
            kk = k - k[:, :, : o["center"]].mean(2, keepdims=True)
        sc_ = 1.0
        if o.get("cscale"):
            sc_ = np.abs(kk[:, :, : o["cscale"]]).max(2, keepdims=True) + 1e-6
            kk = kk / sc_
        kq = (
            fq_channel(kk, o["kb"], o["kchan"])
            if o["kchan"]
            else fq(kk, o["kb"], o["kg"], o["rot"])
        )
        kq = kq * sc_ + (k - kk * sc_)  # undo scale and centering (the mean back in)
        vq = fq(v, o["vb"], o["vg"], o["rot"])
        out = attend(q, kq, vq, k, v, s, o["sink"], o["recent"])
        r = refs[i]
        errs.append(float(np.linalg.norm(out - r) / np.linalg.norm(r)))
    e = np.array(errs)
    g = e[glob].mean() if glob else float("nan")
    wdw = np.delete(e, glob).mean() if glob else e.mean()
    print(
        f"| {spec} | {e.mean():.4f} | {g:.4f} | {wdw:.4f} | {int(e.argmax())}: {e.max():.4f} |",
        flush=True,
    )

"""One msa_decode timing at batch 64, context 32k, M3 shapes (CUDA graph replay)."""
import statistics

import torch

import m3_torch

PAGE = 128


def main():
    torch.manual_seed(0)
    R, L, Hq, Hk, D, Di = 64, 32768, 64, 4, 128, 128
    x = torch.empty(1 << 29, device="cuda"); y = torch.empty_like(x)
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(10):
        s.record(); y.copy_(x); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    bw = 2 * x.numel() * 4 / (statistics.median(ts) * 1e-3)
    del x, y
    lens = (L * (0.9 + 0.2 * torch.rand(R))).int()
    mb = int((lens.max() + PAGE - 1) // PAGE)
    pages = R * mb
    bt = torch.randperm(pages, device="cuda").int().reshape(R, mb)
    k = torch.randn(pages, Hk, PAGE, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ik = torch.randn(pages, PAGE, Di, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(R, Hq, D, device="cuda", dtype=torch.bfloat16)
    iq = torch.randn(R, Hk, Di, device="cuda", dtype=torch.bfloat16)
    sl = lens.cuda().int()
    out = torch.empty_like(q)

    def step():
        return m3_torch.msa_decode(q, iq, k, v, ik, bt, sl, decode_query_len=1, out=out)

    _, ids = step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    parts = {
        "index_scores": lambda: m3_torch.index_scores(iq, ik, bt, sl, decode_query_len=1),
        "sparse_decode": lambda: m3_torch.sparse_decode(q, k, v, ids, bt, sl, decode_query_len=1, out=out),
    }
    res = {}
    for name, fn in [("msa_decode", g.replay), *parts.items()]:
        for _ in range(3):
            fn()
        ts = []
        for _ in range(30):
            s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
        res[name] = statistics.median(ts) * 1e3
    nb = ((lens + PAGE - 1) // PAGE).sum().item()
    idx_bytes = nb * PAGE * Di * 2
    kv_bytes = R * Hk * 16 * PAGE * D * 2 * 2
    floor = (idx_bytes + kv_bytes + 2 * q.numel() * 2) / bw * 1e6
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for name, us in res.items():
        print(f"{name:14s} {us:8.1f} us")
    print(f"msa_decode floor {floor:.1f} us -> {100 * floor / res['msa_decode']:.0f}% of floor")


if __name__ == "__main__":
    main()

"""Host cost of single eager ops on the GPU box (us per call, untraced, median of 200)."""
import time, statistics, torch
d = torch.device("cuda")
def t(f, n=200):
    for _ in range(10): f()
    torch.cuda.synchronize()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); xs.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(xs) * 1e6
lg = torch.randn(384, 49152, device=d, dtype=torch.bfloat16)
small = torch.randn(64, 6, device=d)
idx = torch.arange(32, device=d)
w = torch.randn(49152, 576, device=d, dtype=torch.bfloat16)
h = torch.randn(384, 576, device=d, dtype=torch.bfloat16)
print(f"float() [384,49152] bf16: {t(lambda: lg.float()):.1f} us")
print(f"argmax(-1) [384,49152]: {t(lambda: lg.argmax(-1)):.1f} us")
print(f"linear [384,576]x[576,49152]: {t(lambda: torch.nn.functional.linear(h, w)):.1f} us")
print(f"index_select small: {t(lambda: small.index_select(0, idx)):.1f} us")
print(f"add small: {t(lambda: small + 1):.1f} us")
pin = torch.zeros(4096, dtype=torch.int64, pin_memory=True); dst = torch.zeros(4096, dtype=torch.int64, device=d)
print(f"H2D 32KB pinned non_blocking: {t(lambda: dst.copy_(pin, non_blocking=True)):.1f} us")
g = torch.cuda.CUDAGraph(); x = torch.zeros(64, device=d)
with torch.cuda.graph(g):
    for _ in range(300): x.add_(1)
print(f"graph replay 300 nodes: {t(lambda: g.replay()):.1f} us")
def loop():
    s = 0
    for i in range(64):
        s += min(5, 1000 - i - 1)
    return s
print(f"python 64-iteration loop: {t(loop):.1f} us")

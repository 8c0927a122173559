# Run: python3 tools/mla_narrow_pv_lanes.py (no GPU): checks the lane mapping of pv() in packs/cuda/csrc/mla_narrow.cuh
# over an FP8 latent (the byte-pair transpose, 2026-12-07; docs/cuda.md) and of its output code.
# The FP8 P V fragments of mla_narrow.cuh's pv(), simulated symbolically per lane: every element of
# every B fragment must be (token 16J + k, column c(n)) with c the column the output code assumes.
def lanes(): return [(l // 4, l % 4) for l in range(32)]
for J in range(4):
  for kk in range(4):
    # raw words: thread (g,t), tile j: 4 bytes = token 8j+g, columns 16t+4kk+0..3
    raw = {j: {(g, t): [(8 * j + g, 16 * t + 4 * kk + b) for b in range(4)] for g, t in lanes()} for j in range(8)}
    v = {}
    for jj in range(2):
      w = raw[2 * J + jj]
      M = {(g, 2 * t + u): w[(g, t)][2 * u:2 * u + 2] for g, t in lanes() for u in range(2)}  # 16-bit units
      mm = {(g, t): M[(2 * t, g)] + M[(2 * t + 1, g)] for g, t in lanes()}  # movmatrix.trans
      pm = {k: [x[0], x[2], x[1], x[3]] for k, x in mm.items()}  # __byte_perm(x, 0, 0x3120)
      v[jj] = {0: {k: x[0:2] for k, x in pm.items()}, 1: {k: x[2:4] for k, x in pm.items()}}
    for h in range(2):
      for k in range(16):
        for n in range(8):
          jj, kl = (0, k) if k < 8 else (1, k - 8)
          elem = v[jj][h][(n, kl // 2)][kl % 2]
          want = (16 * J + k, 16 * (n // 2) + 4 * kk + 2 * (n % 2) + h)
          assert elem == want, (J, kk, h, k, n, elem, want)
    # the output code: o[kk][h][2e+q] of thread t is column 16t + 4kk + 2q + h
    for t in range(4):
      for q in range(2):
        for h in range(2):
          n = 2 * t + q
          assert 16 * (n // 2) + 4 * kk + 2 * (n % 2) + h == 16 * t + 4 * kk + 2 * q + h
cols = sorted(4 * kk + 2 * q + h for kk in range(4) for q in range(2) for h in range(2))
assert cols == list(range(16)), cols
print("fragments and output columns agree")

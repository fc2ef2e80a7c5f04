"""An independent NumPy float64 Mamba-1 mixer branch, written from the equations with plain loops.

It shares no code with mlx_llm (tests compare ``mlx_llm.layers.mamba.branch`` with it). Equations:
  y = γ ⊙ h / sqrt(mean(h²) + eps);  x = y W_x, z = y W_z;
  x_t ← SiLU(b_conv + Σ_k conv_w[k] ⊙ x_{t−(W−1)+k})  (positions before the document start count as zero);
  Δ = softplus((x W_dt) W_Δ + b_Δ);  B = x W_B, C = x W_C;  A = −exp(A_log);
  s_{t,i,n} = exp(Δ_{t,i} A_{i,n}) s_{t−1,i,n} + Δ_{t,i} B_{t,n} x_{t,i}  (s = 0 before each document);
  o_{t,i} = Σ_n C_{t,n} s_{t,i,n} + D_i x_{t,i};  out = h + (o ⊙ SiLU(z)) W_out.
"""

import numpy as np


def silu(a):
    return a / (1.0 + np.exp(-a))


def softplus(a):
    return np.logaddexp(0.0, a)


def rms_norm(h, gamma, eps):
    return gamma * h / np.sqrt(np.mean(h * h) + eps)


def document_of(segment_ids, t_len):
    """Start position of the document of each position (0 everywhere when there are no segment ids)."""
    starts = np.zeros(t_len, dtype=int)
    for t in range(1, t_len):
        same = segment_ids is None or segment_ids[t] == segment_ids[t - 1]
        starts[t] = starts[t - 1] if same else t
    return starts


def mixer_row(h, p, eps, segment_ids=None):
    """One row h (T, d) → h + mixer output (T, d)."""
    t_len, _ = h.shape
    width, inner = p["conv_w"].shape
    n_state = p["A_log"].shape[1]
    starts = document_of(segment_ids, t_len)
    x_in = np.zeros((t_len, inner))
    z = np.zeros((t_len, inner))
    for t in range(t_len):
        y = rms_norm(h[t], p["ssm_norm"], eps)
        x_in[t] = y @ p["in_x"]
        z[t] = y @ p["in_z"]
    x = np.zeros((t_len, inner))
    for t in range(t_len):
        for i in range(inner):
            acc = p["conv_b"][i]
            for k in range(width):
                src = t - (width - 1) + k
                if src >= starts[t]:
                    acc += p["conv_w"][k, i] * x_in[src, i]
            x[t, i] = silu(acc)
    a = -np.exp(p["A_log"])
    out = h.copy()
    s = np.zeros((inner, n_state))
    for t in range(t_len):
        if starts[t] == t:
            s = np.zeros((inner, n_state))
        dt = softplus((x[t] @ p["w_dt"]) @ p["dt_proj"] + p["dt_bias"])
        b = x[t] @ p["w_B"]
        c = x[t] @ p["w_C"]
        o = np.zeros(inner)
        for i in range(inner):
            for n in range(n_state):
                s[i, n] = np.exp(dt[i] * a[i, n]) * s[i, n] + dt[i] * b[n] * x[t, i]
                o[i] += c[n] * s[i, n]
            o[i] += p["D"][i] * x[t, i]
        out[t] = h[t] + (o * silu(z[t])) @ p["out_proj"]
    return out


def branch(h, layer, eps, segment_ids=None):
    """h (B, T, d) → (B, T, d); ``segment_ids`` (B, T) or None."""
    p = {k: np.asarray(v, np.float64) for k, v in layer.items()}
    h = np.asarray(h, np.float64)
    seg = None if segment_ids is None else np.asarray(segment_ids)
    return np.stack([mixer_row(h[b], p, eps, None if seg is None else seg[b]) for b in range(h.shape[0])])

"""LARS and LAMB written out in plain PyTorch, from the papers and from Paddle's rule, one parameter at a time.

`paddle=True` follows Paddle's kernels: the layer-wise rate (LARS) or trust ratio (LAMB) applies only to a
parameter with weight decay > 0 and non-zero norms, else the step is a plain momentum (lr) or Adam (ratio 1)
step. `paddle=False` follows the papers, which adapt every layer: You et al. 2017, Algorithm 1 (LARS:
`rate = lr * coeff * |w| / (|g| + wd * |w| + eps)`; `v = m * v + rate * (g + wd * w)`; `w -= v`) and You et
al. 2019, Algorithm 2 (LAMB: `r = m_hat / (sqrt(v_hat) + eps)`; `w -= lr * |w| / |r + wd * w| * (r + wd * w)`),
with a zero norm giving a zero rate / ratio. Everything is computed in float64.
"""
from __future__ import annotations

import torch


def _excluded(name: str, patterns) -> bool:
    return any(p in name for p in patterns)


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return numerator / denominator if denominator > 0 else torch.zeros((), dtype=numerator.dtype)


class Lars:
    """`sgd_weight_decay`: the replaced SGD's own weight decay, added to the gradient first (Paddle's regularizer)."""

    def __init__(self, lr: float, momentum: float, lars_coeff: float, lars_weight_decay: float, epsilon: float,
                 exclude: tuple = (), paddle: bool = True, sgd_weight_decay: float = 0.0):
        self.lr, self.momentum, self.coeff, self.decay, self.eps = lr, momentum, lars_coeff, lars_weight_decay, epsilon
        self.exclude, self.paddle, self.sgd_weight_decay = exclude, paddle, sgd_weight_decay
        self.velocity: dict[str, torch.Tensor] = {}

    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        for name, p in params.items():
            w = p.detach().double()
            g = grads[name].double() + self.sgd_weight_decay * w
            decay = 0.0 if _excluded(name, self.exclude) else self.decay
            w_norm, g_norm = w.norm(), g.norm()
            adapt = (decay > 0 and w_norm > 0 and g_norm > 0) if self.paddle else True
            rate = self.lr * self.coeff * _ratio(w_norm, g_norm + decay * w_norm + self.eps) if adapt else self.lr
            v = self.momentum * self.velocity.get(name, torch.zeros_like(w)) + rate * (g + decay * w)
            self.velocity[name] = v
            p.data.copy_(w - v)


class Lamb:
    def __init__(self, lr: float, beta1: float, beta2: float, epsilon: float, lamb_weight_decay: float,
                 exclude: tuple = (), paddle: bool = True):
        self.lr, self.beta1, self.beta2, self.eps, self.decay = lr, beta1, beta2, epsilon, lamb_weight_decay
        self.exclude, self.paddle = exclude, paddle
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.t = 0

    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        self.t += 1
        for name, p in params.items():
            w, g = p.detach().double(), grads[name].double()
            decay = 0.0 if _excluded(name, self.exclude) else self.decay
            m = self.beta1 * self.m.get(name, torch.zeros_like(w)) + (1 - self.beta1) * g
            v = self.beta2 * self.v.get(name, torch.zeros_like(w)) + (1 - self.beta2) * g * g
            self.m[name], self.v[name] = m, v
            r = (m / (1 - self.beta1**self.t)) / ((v / (1 - self.beta2**self.t)).sqrt() + self.eps) + decay * w
            w_norm, r_norm = w.norm(), r.norm()
            if self.paddle:
                ratio = w_norm / r_norm if decay > 0 and w_norm > 0 and r_norm > 0 else 1.0
            else:
                ratio = _ratio(w_norm, r_norm)
            p.data.copy_(w - self.lr * ratio * r)

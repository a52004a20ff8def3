"""Program rewrites chosen from the strategy: the pass protocol, the manager, the pass order, one subpackage per family.

- `base`: what a pass is (name, summary, the strategy fields it reads, `run`) and its report.
- `manager`: runs passes in order with instruments around each, keeping one record per pass (`History`).
- `instruments`: verification and printing around passes; `progress`: the compile progress bar.
- `order`: the pass order for a strategy, one line of why per pass.
- families: `cleanup`, `precision`, `recompute`, `fusion`, `gradient_merge`, `data_parallel`.
"""

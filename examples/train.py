"""Compile a small classifier's training step with a Fleet-style strategy, train it, and show what fleetc did."""
import torch
import torch.nn.functional as F
from torch import nn

import fleetc


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def main() -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    strategy = fleetc.DistributedStrategy()
    strategy.build_strategy.fuse_bn_act_ops = True  # batch norm + relu → one op (and its backward)
    strategy.build_strategy.fuse_gemm_epilogue = True  # linear + bias → one op (dX, dW, dBias together)
    strategy.build_strategy.fuse_all_optimizer_ops = True  # one multi-tensor AdamW update
    train = fleetc.compile(model, strategy, optimizer=optimizer, loss_fn=F.cross_entropy)

    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    for step in range(5):
        loss = train.step(x, y)
        print(f"step {step}: loss {loss.item():.4f}")
    print(train.report())
    print("eval logits:", tuple(train(x).shape))


if __name__ == "__main__":
    main()

"""Detector-shaped ONNX stand-ins (random weights) for measuring the layerwise calibration's cost.

``yolo``: a YOLOv8n-shaped detector (Conv-BN-SiLU stacks, C2f blocks with residuals, SPPF, an FPN/PAN neck with
upsampling and concats, three decoupled heads concatenated into one output); 64 convs, input 2x3x320x320.
``dbnet``: a DBNet-shaped text detector (a ResNet-ish Conv-BN-ReLU backbone, an FPN whose maps are upsampled to a
quarter of the input and concatenated, a probability head with transposed convs); input 2x3x480x640.

SiLU is exported as Sigmoid and Mul (opset 17), as YOLO exports are. BatchNorm statistics come from a few forward
passes in train mode on random images, so the activations have realistic ranges; BN is then folded by the export.

    python bench/research/detector_standins.py yolo runs/standins/yolo   # writes model.onnx and calib.npz
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def _torch_modules():  # noqa: C901, PLR0915 - one builder, kept together for reading
    import torch
    from torch import nn

    class ConvBnAct(nn.Module):
        def __init__(self, c_in, c_out, k=3, s=1, act="silu"):
            super().__init__()
            self.conv = nn.Conv2d(c_in, c_out, k, s, k // 2, bias=False)
            self.bn = nn.BatchNorm2d(c_out)
            self.act = act

        def forward(self, x):
            x = self.bn(self.conv(x))
            return x * torch.sigmoid(x) if self.act == "silu" else torch.relu(x)

    class Bottleneck(nn.Module):
        def __init__(self, c, shortcut=True):
            super().__init__()
            self.cv1, self.cv2, self.add = ConvBnAct(c, c), ConvBnAct(c, c), shortcut

        def forward(self, x):
            y = self.cv2(self.cv1(x))
            return x + y if self.add else y

    class C2f(nn.Module):
        def __init__(self, c_in, c_out, n=1, shortcut=True):
            super().__init__()
            self.c = c_out // 2
            self.cv1 = ConvBnAct(c_in, 2 * self.c, 1)
            self.cv2 = ConvBnAct((2 + n) * self.c, c_out, 1)
            self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

        def forward(self, x):
            y = list(self.cv1(x).chunk(2, 1))
            y.extend(m(y[-1]) for m in self.m)
            return self.cv2(torch.cat(y, 1))

    class SPPF(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.cv1, self.cv2 = ConvBnAct(c, c // 2, 1), ConvBnAct(c * 2, c, 1)
            self.pool = nn.MaxPool2d(5, 1, 2)

        def forward(self, x):
            x = self.cv1(x)
            y1 = self.pool(x)
            y2 = self.pool(y1)
            return self.cv2(torch.cat([x, y1, y2, self.pool(y2)], 1))

    class Yolo(nn.Module):
        def __init__(self, w=(16, 32, 64, 128, 256), classes=80):
            super().__init__()
            self.stem = nn.Sequential(ConvBnAct(3, w[0], 3, 2), ConvBnAct(w[0], w[1], 3, 2), C2f(w[1], w[1]))
            self.p3 = nn.Sequential(ConvBnAct(w[1], w[2], 3, 2), C2f(w[2], w[2], 2))
            self.p4 = nn.Sequential(ConvBnAct(w[2], w[3], 3, 2), C2f(w[3], w[3], 2))
            self.p5 = nn.Sequential(ConvBnAct(w[3], w[4], 3, 2), C2f(w[4], w[4]), SPPF(w[4]))
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.n4 = C2f(w[4] + w[3], w[3], shortcut=False)
            self.n3 = C2f(w[3] + w[2], w[2], shortcut=False)
            self.d3 = ConvBnAct(w[2], w[2], 3, 2)
            self.m4 = C2f(w[2] + w[3], w[3], shortcut=False)
            self.d4 = ConvBnAct(w[3], w[3], 3, 2)
            self.m5 = C2f(w[3] + w[4], w[4], shortcut=False)
            self.heads = nn.ModuleList(
                nn.Sequential(ConvBnAct(c, 64), ConvBnAct(64, 64), nn.Conv2d(64, 4 + classes, 1)) for c in w[2:]
            )

        def forward(self, x):
            p3 = self.p3(self.stem(x))
            p4 = self.p4(p3)
            p5 = self.p5(p4)
            n4 = self.n4(torch.cat([self.up(p5), p4], 1))
            n3 = self.n3(torch.cat([self.up(n4), p3], 1))
            m4 = self.m4(torch.cat([self.d3(n3), n4], 1))
            m5 = self.m5(torch.cat([self.d4(m4), p5], 1))
            outs = [head(f).flatten(2) for head, f in zip(self.heads, (n3, m4, m5), strict=True)]
            return torch.cat(outs, 2)

    class DBNet(nn.Module):
        def __init__(self, w=(32, 64, 128, 256), inner=64):
            super().__init__()
            stages, c = [], 16
            self.stem = nn.Sequential(ConvBnAct(3, 16, 3, 2, "relu"), ConvBnAct(16, 16, 3, 2, "relu"))
            for i, width in enumerate(w):
                stride = 1 if i == 0 else 2
                stages.append(
                    nn.Sequential(
                        ConvBnAct(c, width, 3, stride, "relu"),
                        ConvBnAct(width, width, 3, 1, "relu"),
                        ConvBnAct(width, width, 3, 1, "relu"),
                    )
                )
                c = width
            self.stages = nn.ModuleList(stages)
            self.lateral = nn.ModuleList(nn.Conv2d(width, inner, 1) for width in w)
            self.smooth = nn.ModuleList(nn.Conv2d(inner, inner // 4, 3, padding=1) for _ in w)
            self.head = nn.Sequential(
                ConvBnAct(inner, inner // 4, 3, 1, "relu"),
                nn.ConvTranspose2d(inner // 4, inner // 4, 2, 2),
                nn.BatchNorm2d(inner // 4),
                nn.ReLU(),
                nn.ConvTranspose2d(inner // 4, 1, 2, 2),
                nn.Sigmoid(),
            )

        def forward(self, x):
            x = self.stem(x)
            feats = []
            for stage in self.stages:
                x = stage(x)
                feats.append(x)
            lat = [conv(f) for conv, f in zip(self.lateral, feats, strict=True)]
            for i in range(len(lat) - 2, -1, -1):
                lat[i] = lat[i] + nn.functional.interpolate(lat[i + 1], size=lat[i].shape[2:], mode="nearest")
            size = lat[0].shape[2:]
            maps = [
                nn.functional.interpolate(conv(f), size=size, mode="nearest") if i else conv(f)
                for i, (conv, f) in enumerate(zip(self.smooth, lat, strict=True))
            ]
            return self.head(torch.cat(maps, 1))

    return torch, {"yolo": (Yolo, (2, 3, 320, 320)), "dbnet": (DBNet, (2, 3, 480, 640))}


def images(shape: tuple[int, ...], count: int, seed: int = 0) -> np.ndarray:
    """``count`` smooth random images in [0, 1] (blurred noise plus gradients: activations that are not white noise)."""
    rng = np.random.default_rng(seed)
    n, c, h, w = shape
    coarse = rng.uniform(0, 1, size=(count * n, c, h // 16 + 1, w // 16 + 1)).astype(np.float32)
    smooth = coarse.repeat(16, axis=2).repeat(16, axis=3)[:, :, :h, :w]
    noise = rng.normal(0, 0.05, size=(count * n, c, h, w)).astype(np.float32)
    return np.clip(smooth + noise, 0, 1).astype(np.float32)


def export(kind: str, out_dir: Path, batches: int = 8) -> Path:
    """Writes ``model.onnx`` (opset 17) and ``calib.npz`` (``batches`` batches under the name ``images``)."""
    torch, builders = _torch_modules()
    build, shape = builders[kind]
    torch.manual_seed(0)
    net = build()
    warm = torch.from_numpy(images(shape, 4, seed=1))
    net.train()
    with torch.no_grad():
        for chunk in warm.split(shape[0]):
            net(chunk)
    net.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    example = torch.from_numpy(images(shape, 1, seed=2))
    torch.onnx.export(
        net, (example,), str(path), input_names=["images"], output_names=["out"], opset_version=17, dynamo=False
    )
    np.savez(out_dir / "calib.npz", images=images(shape, batches, seed=3))
    return path


if __name__ == "__main__":
    print(export(sys.argv[1], Path(sys.argv[2])))

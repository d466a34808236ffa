"""What the hybrid families' FP tests share: random weights of a realistic scale for a
transformers reference model, random token ids, and the relative error they compare by."""
import torch


@torch.no_grad()
def randomize_(model, dt_bias_shift: float = -4.5):
    """Random weights of realistic scale; dt_bias around ``dt_bias_shift``, low enough that Δ's
    floor binds on some tokens; norm weights near 1."""
    for name, param in model.named_parameters():
        if name.endswith("A_log"):
            param.copy_(torch.log(torch.rand_like(param) * 15 + 1))
        elif name.endswith(".D"):
            param.copy_(torch.rand_like(param) + 0.5)
        elif name.endswith("dt_bias"):
            param.copy_(torch.randn_like(param) + dt_bias_shift)
        elif "norm" in name:
            param.copy_(1 + 0.1 * torch.randn_like(param))
        else:
            param.copy_(torch.randn_like(param) * 0.2)
    return model


def token_ids(vocab_size: int, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()

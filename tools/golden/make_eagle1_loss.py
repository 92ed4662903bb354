"""Reference numbers for `eagle_jax.training.objective.eagle1_loss`: one forward and backward of the official
EAGLE-1 objective (the v1 branch of SafeAILab/EAGLE, `eagle/train/main.py`) on the golden EAGLE-1 head and
target, written to tests/golden/eagle1_loss.npz.

Runs the official head (`eagle/model/cnets.py: Model`, unmodified, imported from a checkout of the v1 branch)
under torch; the loss lines follow main.py's training loop (noise off, p_w 0.1, v_w 1.0, SmoothL1 with beta 1,
the 1e-5 in the normalisers, top-k accuracies over the masked positions against the target's argmax).

    mkdir .eagle_v1 && git -C EAGLE archive v1 eagle/model | tar -x -C .eagle_v1   # EAGLE: a clone of SafeAILab/EAGLE
    python tools/golden/make_eagle1_loss.py --eagle-src .eagle_v1 --golden tests/golden
(torch 2.13.0, transformers 4.53.3, safetensors, numpy, in an environment of their own.)
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaForCausalLM

P_W, V_W = 0.1, 1.0


def batch(target: LlamaForCausalLM, vocab: int, lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """A right-padded batch as v1's dataset and collator hand it (sequences the target continues greedily from
    3 random tokens): the target's final normed hidden states,
    input ids and target features shifted one step left and zero-padded, loss mask with its last position 0."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    rows = {k: [] for k in ("hidden_states", "input_ids", "target", "attention_mask", "loss_mask")}
    for n in lengths:
        ids = torch.randint(3, vocab, (1, 3), generator=g)
        with torch.no_grad():  # the target's own greedy continuation, which the head learned to predict
            ids = target.generate(ids, max_new_tokens=n - 3, min_new_tokens=n - 3, do_sample=False)[:, :n]
            hidden = target(ids, output_hidden_states=True).hidden_states[-1]  # [1, n, H], final norm applied
        loss_mask = [0] * (n // 3) + [1] * (n - n // 3)
        loss_mask[-1] = 0
        pad = t - n
        zeros = torch.zeros(1, 1, hidden.shape[-1])
        rows["hidden_states"].append(torch.cat([hidden, torch.zeros(1, pad, hidden.shape[-1])], 1))
        rows["input_ids"].append(torch.cat([ids[:, 1:], torch.zeros(1, 1 + pad, dtype=torch.long)], 1))
        rows["target"].append(torch.cat([hidden[:, 1:], zeros, torch.zeros(1, pad, hidden.shape[-1])], 1))
        rows["attention_mask"].append(torch.tensor([[1] * n + [0] * pad]))
        rows["loss_mask"].append(torch.tensor([loss_mask + [0] * pad]))
    return {k: torch.cat(v) for k, v in rows.items()}


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--eagle-src", required=True, help="a folder holding the v1 branch's eagle/model")
    a.add_argument("--golden", default="tests/golden")
    a = a.parse_args()
    sys.path.insert(0, a.eagle_src)
    from eagle.model.cnets import Model  # the official v1 EAGLE-1 head
    from eagle.model.configs import EConfig

    golden = Path(a.golden)
    torch.manual_seed(0)
    target = LlamaForCausalLM.from_pretrained(golden / "target", torch_dtype=torch.float32).eval()
    config = EConfig.from_pretrained(golden / "eagle1")
    model = Model(config, load_emb=True, path=str(golden / "target"), bias=config.bias).float()
    missing, unexpected = model.load_state_dict(torch.load(golden / "eagle1" / "pytorch_model.bin"), strict=False)
    assert set(missing) <= {"embed_tokens.weight"} and not unexpected, (missing, unexpected)
    model.train()
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    head.weight.data = load_file(golden / "target" / "model.safetensors")["lm_head.weight"].float()
    for p in head.parameters():
        p.requires_grad = False
    data = batch(target, config.vocab_size, [24, 15], seed=1)

    # the v1 training loop's loss, noise off
    criterion = nn.SmoothL1Loss(reduction="none")
    predict = model(data["hidden_states"], input_ids=data["input_ids"], attention_mask=data["attention_mask"])
    with torch.no_grad():
        target_head = head(data["target"])
        target_p = nn.Softmax(dim=2)(target_head).detach()
    out_head = head(predict)
    out_logp = nn.LogSoftmax(dim=2)(out_head)
    loss_mask = data["loss_mask"][:, :, None]
    ploss = -torch.sum(torch.sum(loss_mask * target_p * out_logp, 2)) / (loss_mask.sum() + 1e-5)
    vloss = criterion(predict, data["target"])
    vloss = torch.sum(torch.mean(loss_mask * vloss, 2)) / (loss_mask.sum() + 1e-5)
    loss = V_W * vloss + P_W * ploss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    grad_norm = torch.sqrt(sum(torch.sum(g.double() ** 2) for g in grads.values()))
    with torch.no_grad():
        wanted = torch.max(target_head, 2)[1].view(-1)[loss_mask.view(-1) == 1]
        logits = out_head.view(-1, target_head.shape[-1])[loss_mask.view(-1) == 1]
        top = logits.topk(3, 1, True, True)[1].t()
        correct = top.eq(wanted.view(1, -1).expand_as(top))
        ct = loss_mask.sum().item()
        acc = [correct[: k + 1].reshape(-1).float().sum().item() / ct for k in range(3)]

    out = {k: v.numpy() for k, v in data.items()}
    out |= {"predict": predict.detach().numpy(), "loss": loss.item(), "vloss": vloss.item(), "ploss": ploss.item()}
    out |= {"top1": acc[0], "top2": acc[1], "top3": acc[2], "grad_norm": grad_norm.item()}
    out |= {f"grad/{n}": g.numpy() for n, g in grads.items()}
    np.savez_compressed(golden / "eagle1_loss.npz", **out)
    print(json.dumps({k: v for k, v in out.items() if np.ndim(v) == 0}, indent=1))


if __name__ == "__main__":
    main()

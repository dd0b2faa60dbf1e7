"""How much an int8 LM head (model.quantize_head) moves a real model's loss: SmolLM2-135M-Instruct
(the built-in model), its tied head quantized as cpudist stores an untied one (int8, a scale per
vocabulary row), the mean token loss on every English chatterbot-corpus QA pair, fp32 compute so
that only the head differs. Run from the repository root after the quickstart has converted the
model: python docs/bench/issue33/head_int8/quality.py"""

from __future__ import annotations

import json
from pathlib import Path

import chatterbot_corpus
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from cpudist.model.loss import CausalLMLoss
from cpudist.model.quantize import METHODS, QuantizedHead

MODEL = Path(".cache/models/smollm2-135m-instruct")
torch.manual_seed(0)
tokenizer = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
pairs = []
for file in sorted((Path(chatterbot_corpus.__file__).parent / "data" / "english").glob("*.yml")):
    for talk in yaml.safe_load(file.read_text()).get("conversations", []):
        if len(talk) >= 2 and all(isinstance(t, str) for t in talk[:2]):
            pairs.append(tokenizer.apply_chat_template(
                [{"role": "user", "content": talk[0]}, {"role": "assistant", "content": talk[1]}],
                tokenize=False))


def mean_loss(loss: CausalLMLoss) -> float:
    total = count = 0.0
    with torch.no_grad():
        for text in pairs:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            out = loss(ids, torch.ones_like(ids), ids.clone())
            total, count = total + float(out.total), count + float(out.count)
    return total / count


plain = mean_loss(CausalLMLoss(model, 512))
weight = model.get_output_embeddings().weight.detach()
head = QuantizedHead(weight.shape[1], weight.shape[0], False, "int8", 0, torch.float32, "cpu")
for name, tensor in METHODS["int8"].quantize(weight, 0, torch.float32).items():
    getattr(head, name).copy_(tensor)
quantized_loss = CausalLMLoss(model, 512)
quantized_loss.head = head
quantized = mean_loss(quantized_loss)
result = {"pairs": len(pairs), "loss_plain_head": plain, "loss_int8_head": quantized,
          "relative_change": quantized / plain - 1}
print(json.dumps(result, indent=1))
Path(__file__).with_name("quality.json").write_text(json.dumps(result, indent=1) + "\n")

"""Tiny Hugging Face `transformers` architectures, built from configs in code (never from the hub).

Each factory returns a `ModelCase`: the model, a batch maker and the loss the training step minimises. The
configs are as small as each architecture allows (2 layers, width 32) so one differential run takes seconds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH, WIDTH = 64, 8, 2, 32


@dataclass
class ModelCase:
    """A model with what a training step on it needs; `make_batch(generator)` gives (args, kwargs), the target
    last in args."""

    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[tuple, dict]]
    loss_fn: Callable

    def build(self, steps: int) -> tuple[nn.Module, list[tuple[tuple, dict]]]:
        """The model (seeded) and `steps` batches (seeded)."""
        torch.manual_seed(0)
        model = self.make_model()
        g = torch.Generator().manual_seed(1)
        return model, [self.make_batch(g) for _ in range(steps)]


def _tokens(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _lm_loss(out, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss over the logits (any vocabulary position), as a causal LM's own loss computes it."""
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _class_loss(out, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, labels)


def _token_batch(g: torch.Generator) -> tuple[tuple, dict]:
    return (_tokens(g), _tokens(g)), {}


def _class_batch(g: torch.Generator) -> tuple[tuple, dict]:
    return (_tokens(g), torch.randint(0, 3, (BATCH,), generator=g)), {}


def _image_batch(size: int = 32, classes: int = 3, batch: int = BATCH) -> Callable:
    def make(g: torch.Generator) -> tuple[tuple, dict]:
        return (torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)), {}
    return make


def _decoder(config_name: str, model_name: str, **extra) -> ModelCase:
    """A causal LM from `transformers.<config_name>(**small sizes, **extra)`."""
    def make() -> nn.Module:
        import transformers
        config = getattr(transformers, config_name)(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    max_position_embeddings=64, **extra)
        config._attn_implementation = "sdpa"
        return getattr(transformers, model_name)(config).train()
    return ModelCase(make, _token_batch, _lm_loss)


def _hf(config_name: str, model_name: str, make_batch: Callable, loss_fn: Callable, **config) -> ModelCase:
    def make() -> nn.Module:
        import transformers
        cfg = getattr(transformers, config_name)(**config)
        return getattr(transformers, model_name)(cfg).train()
    return ModelCase(make, make_batch, loss_fn)


def gpt2() -> ModelCase:
    return _hf("GPT2Config", "GPT2LMHeadModel", _token_batch, _lm_loss, vocab_size=VOCAB, n_embd=WIDTH, n_layer=2,
               n_head=4, n_positions=64)


def llama() -> ModelCase:
    return _decoder("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2)


def mistral() -> ModelCase:
    return _decoder("MistralConfig", "MistralForCausalLM", num_key_value_heads=2)


def qwen2() -> ModelCase:
    return _decoder("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2)


def gemma() -> ModelCase:
    return _decoder("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=2, head_dim=8)


def phi() -> ModelCase:
    return _decoder("PhiConfig", "PhiForCausalLM")


def opt() -> ModelCase:
    return _hf("OPTConfig", "OPTForCausalLM", _token_batch, _lm_loss, vocab_size=VOCAB, hidden_size=WIDTH, ffn_dim=64,
               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=WIDTH)


def gpt_neox() -> ModelCase:
    return _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM")


class _Seq2Seq(nn.Module):
    """Feeds the labels shifted right as decoder inputs, as a seq2seq model's `labels=` path does."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids)


def _seq2seq(config_name: str, model_name: str, **config) -> ModelCase:
    def make() -> nn.Module:
        import transformers
        return _Seq2Seq(getattr(transformers, model_name)(getattr(transformers, config_name)(**config)).train())

    def batch(g: torch.Generator) -> tuple[tuple, dict]:
        labels = _tokens(g)
        return (_tokens(g), labels.roll(1, dims=1), labels), {}
    return ModelCase(make, batch, _lm_loss)


def t5() -> ModelCase:
    return _seq2seq("T5Config", "T5ForConditionalGeneration",
                    vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                    relative_attention_num_buckets=8, decoder_start_token_id=0)


def bart() -> ModelCase:
    return _seq2seq("BartConfig", "BartForConditionalGeneration",
                    vocab_size=VOCAB, d_model=WIDTH, encoder_layers=1, decoder_layers=1,
                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                    max_position_embeddings=64)


class _Whisper(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_features: torch.Tensor, decoder_input_ids: torch.Tensor):
        return self.model(input_features=input_features, decoder_input_ids=decoder_input_ids)


def whisper() -> ModelCase:
    def make() -> nn.Module:
        import transformers
        config = transformers.WhisperConfig(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=1, decoder_layers=1,
                                            encoder_attention_heads=4, decoder_attention_heads=4,
                                            encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                                            max_source_positions=8, max_target_positions=16,
                                            decoder_start_token_id=0, pad_token_id=0)
        return _Whisper(transformers.WhisperForConditionalGeneration(config).train())

    def batch(g: torch.Generator) -> tuple[tuple, dict]:
        labels = _tokens(g)
        return (torch.randn(BATCH, 8, 16, generator=g), labels.roll(1, dims=1), labels), {}
    return ModelCase(make, batch, _lm_loss)


def _encoder(config_name: str, **extra) -> ModelCase:
    """A sequence classifier from `transformers.<config_name>` with small sizes."""
    model_name = config_name.removesuffix("Config") + "ForSequenceClassification"
    return _hf(config_name, model_name, _class_batch, _class_loss,
               **{"vocab_size": VOCAB, "hidden_size": WIDTH, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "intermediate_size": 64, "max_position_embeddings": 64, "num_labels": 3, **extra})


def bert() -> ModelCase:
    return _encoder("BertConfig")


def roberta() -> ModelCase:
    return _encoder("RobertaConfig")


def distilbert() -> ModelCase:
    return _hf("DistilBertConfig", "DistilBertForSequenceClassification", _class_batch, _class_loss,
               vocab_size=VOCAB, dim=WIDTH, n_layers=2, n_heads=4,
               hidden_dim=64, max_position_embeddings=64, num_labels=3)


def albert() -> ModelCase:
    return _encoder("AlbertConfig", embedding_size=16)


def deberta_v2() -> ModelCase:
    return _encoder("DebertaV2Config", relative_attention=True, position_buckets=8,
                    pos_att_type=["p2c", "c2p"])


def electra() -> ModelCase:
    return _encoder("ElectraConfig", embedding_size=16)


def vit() -> ModelCase:
    return _hf("ViTConfig", "ViTForImageClassification", _image_batch(), _class_loss, image_size=32, patch_size=8,
               hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=3)


def swin() -> ModelCase:
    return _hf("SwinConfig", "SwinForImageClassification", _image_batch(), _class_loss, image_size=32, patch_size=4,
               embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3)


def convnext() -> ModelCase:
    return _hf("ConvNextConfig", "ConvNextForImageClassification", _image_batch(), _class_loss, num_channels=3,
               num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)


def resnet() -> ModelCase:
    return _hf("ResNetConfig", "ResNetForImageClassification", _image_batch(), _class_loss, embedding_size=8,
               hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)


def mobilenet_v2() -> ModelCase:
    """Sized so that a few SGD steps are stable to rounding (docs/models.md, "MobileNetV2's configuration"):
    BatchNorm sees at least 4 x 8 x 8 values per channel (batch 4, 64x64 images, output_stride 8 dilates the last
    stages instead of shrinking their maps to 2x2), the head has 320 features instead of 1280 (finegrained_output
    off), classifier dropout is off, and the convolutions are initialized as torchvision's MobileNetV2 does
    (kaiming fan_out): transformers' std 0.02 makes the first SGD step change the early convolutions by more than
    their own norm (BatchNorm makes them scale-invariant), which left float64 training several % from float32's."""
    case = _hf("MobileNetV2Config", "MobileNetV2ForImageClassification", _image_batch(64, batch=4), _class_loss,
               image_size=64, depth_multiplier=0.25, output_stride=8, finegrained_output=False,
               classifier_dropout_prob=0.0, num_labels=3)
    make = case.make_model

    def make_model() -> nn.Module:
        model = make()
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
        return model
    return dataclasses.replace(case, make_model=make_model)


def wav2vec2() -> ModelCase:
    """`layerdrop=0`: layer drop skips layers on a random draw (data-dependent control flow, not capturable)."""
    def batch(g: torch.Generator) -> tuple[tuple, dict]:
        return (torch.randn(BATCH, 400, generator=g), torch.randint(0, 3, (BATCH,), generator=g)), {}
    return _hf("Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", batch, _class_loss, hidden_size=WIDTH,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
               conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
               num_labels=3, mask_time_prob=0.0, layerdrop=0.0, classifier_proj_size=16)


class _Clip(nn.Module):
    """CLIP's contrastive logits: image i matches text i."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor):
        return self.model(input_ids=input_ids, pixel_values=pixel_values)


def _clip_loss(out, labels: torch.Tensor) -> torch.Tensor:
    return (F.cross_entropy(out.logits_per_image, labels) + F.cross_entropy(out.logits_per_text, labels)) / 2


def clip() -> ModelCase:
    def make() -> nn.Module:
        import transformers
        text = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=SEQ)
        vision = dict(hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      image_size=32, patch_size=8)
        config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
        return _Clip(transformers.CLIPModel(config).train())

    def batch(g: torch.Generator) -> tuple[tuple, dict]:
        return (_tokens(g), torch.randn(BATCH, 3, 32, 32, generator=g), torch.arange(BATCH)), {}
    return ModelCase(make, batch, _clip_loss)


ARCHITECTURES: dict[str, Callable[[], ModelCase]] = {
    "gpt2": gpt2, "llama": llama, "mistral": mistral, "qwen2": qwen2, "gemma": gemma, "phi": phi, "opt": opt,
    "gpt_neox": gpt_neox, "t5": t5, "bart": bart, "whisper": whisper, "bert": bert, "roberta": roberta,
    "distilbert": distilbert, "albert": albert, "deberta_v2": deberta_v2, "electra": electra, "vit": vit,
    "swin": swin, "convnext": convnext, "resnet": resnet, "mobilenet_v2": mobilenet_v2, "wav2vec2": wav2vec2,
    "clip": clip,
}


def explain_factory(name: str) -> Callable[[], dict]:
    """A `fleetc explain` / `fleetc dump-ir` factory for the architecture `name`: its model and one batch."""
    def factory() -> dict:
        case = ARCHITECTURES[name]()
        model, [(args, kwargs)] = case.build(1)
        return {"model": model, "args": args, "kwargs": kwargs, "loss_fn": case.loss_fn}
    return factory


# `fleetc explain tests.models.factories:<name>` for every architecture.
globals().update({f"{name}_step": explain_factory(name) for name in ARCHITECTURES})

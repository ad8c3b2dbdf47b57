"""Typed configuration: YAML file + dotted `key=value` overrides -> validated `Config`.

Every error is a `ConfigError` whose one-line message names the offending key or file; the command
line turns it into exit status 2.
"""

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from islands.errors import ConfigError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_boundaries(b: list[float] | None) -> None:
    """Timestep-range boundaries in canonical t."""
    if b is not None and (len(b) < 3 or b[0] != 0 or b[-1] != 1 or sorted(set(b)) != b):
        raise ValueError(f"t_ranges: must rise strictly from 0 to 1 through at least one boundary, got {b}")


# --- data: one variant per source, told apart by `source` ---

class _Data(Section):
    flip: bool | None = None  # None: the source's own default (flip natural images only)
    workers: int = Field(0, ge=0)
    # Written by `islands ddm` into the runs it derives: a partition folder, and the cluster an expert keeps
    # (None: every example, labelled with its cluster, for the router).
    partition: str | None = None
    cluster: int | None = Field(None, ge=0)
    # local_sgd, diloco: a partition folder (`islands partition`) whose cluster r is replica r's data (non-IID)
    shards: str | None = None
    # latent diffusion: an AutoencoderKL folder (config.json + diffusion_pytorch_model.safetensors, a user's SD VAE or
    # RUN/autoencoder of our own); each batch is encoded before the objective and samples are decoded
    autoencoder: str | None = None
    # model.condition image: the side of the low-resolution condition, area-averaged from each example
    condition_resolution: int | None = Field(None, gt=0)
    # a text-conditioned run's captions encoder: "minilm" (MiniLM-L6, bundled in the `text` extra) or a folder of a
    # transformers text model (CLIP's, T5's, ...; islands/nets/text_folder.py)
    text_encoder: str = "minilm"
    # the order examples are read in (islands/data/order.py): global, a permutation of all of them per epoch; blocks,
    # shuffled blocks of contiguous examples of one shard, a window of blocks at a time (for slow storage: the
    # default for shards at a URL, global elsewhere)
    order: Literal["global", "blocks"] = "global"
    # order blocks: the examples of a block, read together
    block: int = Field(256, ge=1)
    # order blocks: the blocks read at once, their examples shuffled together (what a batch mixes)
    window: int = Field(8, ge=1)


# the keys every data variant has; the others are its source's own (islands/data/registry.py builds it from them)
COMMON_DATA_KEYS = frozenset(_Data.model_fields)


class Mnist5kData(_Data):
    source: Literal["mnist5k"] = "mnist5k"
    resolution: int | None = Field(None, gt=0)


class FashionMnistData(_Data):
    source: Literal["fashion_mnist"] = "fashion_mnist"
    path: str | None = None  # None: Debian's dataset-fashion-mnist
    split: Literal["train", "test"] = "train"
    resolution: int | None = Field(None, gt=0)


class FolderData(_Data):
    source: Literal["folder"] = "folder"
    path: str
    resolution: int = Field(gt=0)
    channels: Literal[1, 3] = 3
    # The grey level (0 black to 255 white) that images with transparency are composited onto; None: white.
    background: int | None = Field(None, ge=0, le=255)
    # what a run checks before its first step, so that a bad file stops it there and not when a batch reaches it:
    # decode every image (remembered per state of the files), or open each one and verify its structure only
    check: Literal["decode", "headers"] = "decode"
    # captions: NAME.txt beside NAME.png, or Hugging Face's metadata.jsonl/.csv (file_name and this column)
    caption_key: str = "text"
    # an image without a caption in a captioned folder: refused (naming it), or trained with the empty caption
    missing_caption: Literal["refuse", "empty"] = "refuse"


class HfData(_Data):
    """A Hugging Face dataset on disk (islands/data/hf.py): a folder that save_to_disk wrote, or parquet files (a folder
    or a glob). Never a hub id: nothing is fetched, and no dataset script is run."""
    source: Literal["hf"] = "hf"
    path: str
    resolution: int = Field(gt=0)
    split: str | None = None  # a DatasetDict's split, or the parquet files' (None: the only one, else train)
    # the columns; None: "image", "text" (captions, where the dataset has it), "label" (classes, where it has it)
    image_key: str | None = None
    caption_key: str | None = None
    label_key: str | None = None
    channels: Literal[1, 3] = 3
    # The grey level (0 black to 255 white) that images with transparency are composited onto; None: white.
    background: int | None = Field(None, ge=0, le=255)


class EmojiData(_Data):
    """Noto Color Emoji's emoji (islands/data/emoji.py): colour images labelled by their group, with captions."""
    source: Literal["emoji"] = "emoji"
    resolution: int = Field(32, gt=0)
    # The grey level (0 black to 255 white) that the glyphs' transparency is composited onto: white, as they are seen
    background: int = Field(255, ge=0, le=255)
    skin_tones: bool = True  # False: only each person's and hand's default (yellow) tone
    limit: int | None = Field(None, gt=0)  # the first emoji only (after skin_tones): a quick look
    font: str | None = None  # None: Debian's fonts-noto-color-emoji
    emoji_test: str | None = None  # Unicode's emoji-test.txt; None: Debian's unicode-data


class NpzData(_Data):
    source: Literal["npz"] = "npz"
    path: str
    key: str = "x"
    label_key: str = "y"
    resolution: int | None = Field(None, gt=0)


class ShardsData(_Data):
    source: Literal["shards"] = "shards"
    path: str  # a folder written by `islands shard`, or by `islands index` (tars indexed where they lie)
    # indexed tars keep their images' own sizes: a run resizes (shorter side) and centre-crops them to `resolution`
    # (required there) in `channels` (None: 3), onto `background` where transparent, as the folder source does;
    # `islands shard`'s examples are read at their stored shape (leave both out)
    resolution: int | None = Field(None, gt=0)
    channels: Literal[1, 3] | None = None
    background: int | None = Field(None, ge=0, le=255)
    # a member that fails its sha256 or does not decode when read: stop the run naming it (exit 2), or replace the
    # example by the next good one of the data set and count it (skipped_examples in metrics.jsonl)
    on_error: Literal["stop", "skip"] = "stop"
    # shards at a URL: a local folder that keeps their tars whole, shared safely by loader workers and ranks; None:
    # blocks read by ranged requests, nothing kept on disk
    cache: str | None = None
    # data.cache's budget in bytes: past it the least recently used tars are removed first; None: no limit
    cache_bytes: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _order_for_urls(self):
        """Object stores serve long ranges well and single examples badly: blocks, unless the config says."""
        from islands.data.storage import is_url

        if "order" not in self.model_fields_set and is_url(self.path):
            self.order = "blocks"
        return self


class GMMData(_Data):
    source: Literal["gmm"] = "gmm"
    means: list[list[float]]
    std: float = Field(0.1, gt=0)
    weights: list[float] | None = None
    size: int = Field(50_000, gt=0)

    @model_validator(mode="after")
    def _check(self):
        if not self.means or len({len(m) for m in self.means}) != 1 or not self.means[0]:
            raise ValueError("means: must be a non-empty list of vectors of one dimension")
        if self.weights is not None and (len(self.weights) != len(self.means) or min(self.weights) < 0):
            raise ValueError(f"weights: must be {len(self.means)} non-negative numbers")
        return self


DataConfig = Annotated[Mnist5kData | FashionMnistData | FolderData | HfData | EmojiData | NpzData | ShardsData
                       | GMMData, Field(discriminator="source")]


def captioned(data) -> bool:
    """Whether the data has captions: the emoji, an image folder that keeps them, a Hugging Face dataset with a caption
    column, or shards whose examples hold one."""
    if data.source == "emoji":
        return True
    if data.source == "folder":
        from islands.data.sources import has_captions

        return has_captions(data.path)
    if data.source == "hf":  # its schema only: no row is read
        from islands.data.hf import has_captions as hf_has_captions

        try:
            return hf_has_captions(data.path, data.caption_key, data.split)
        except (ValueError, OSError, ImportError):
            return False  # refused, by name, where the run opens it
    if data.source != "shards":
        return False
    from islands.data.shards import read_manifest

    try:
        return "txt" in read_manifest(data.path).members
    except (OSError, ValueError):  # a DataError too
        return False  # a folder that cannot be read is refused, by name, where the run opens it


TEXT_ARCHS = ("dit", "unet", "router")  # the networks that read a caption (a router its pooled vector only)
# the diffusers denoisers `model.arch: diffusers` builds (islands/nets/diffusers_net.py), and those that read a caption
DIFFUSERS_CLASSES = ("UNet2DModel", "DiTTransformer2DModel", "UNet2DConditionModel", "SD3Transformer2DModel",
                     "FluxTransformer2DModel")
DIFFUSERS_TEXT = ("UNet2DConditionModel", "SD3Transformer2DModel", "FluxTransformer2DModel")


def reads_text(model) -> bool:
    """Whether the network a model config names can read a caption."""
    return model.arch in TEXT_ARCHS or model.arch == "diffusers" and model.class_name in DIFFUSERS_TEXT


# --- model: one variant per network, told apart by `arch` (the registry is islands/nets/__init__.py) ---

class _Model(Section):
    num_classes: int = Field(0, ge=0)  # 0: unconditional; else must match the data's labels
    # what the network is conditioned on; None: a class with num_classes, else a caption where the data has captions
    # (data.source emoji, or shards with captions) and the network reads text (dit), else nothing
    condition: Literal["none", "class", "text", "image"] | None = None
    # text: the most tokens of a caption (longer ones are cut), and the encoder's widths (None: its config's)
    text_tokens: int = Field(32, gt=0)
    text_width: int | None = Field(None, gt=0)
    text_pooled_width: int | None = Field(None, gt=0)


class UNetModel(_Model):
    arch: Literal["unet"] = "unet"
    channels: int = Field(64, gt=0)
    channel_mult: list[int] = [1, 2, 2]
    num_res_blocks: int = Field(2, gt=0)
    attention_resolutions: list[int] = [16]
    dropout: float = Field(0.0, ge=0, lt=1)
    num_heads: int | None = Field(None, gt=0)


class DiTModel(_Model):
    arch: Literal["dit"] = "dit"
    preset: Literal["S", "B", "L", "XL"] = "S"
    patch_size: int = Field(2, gt=0)
    hidden_size: int | None = Field(None, gt=0)  # None: the preset's
    depth: int | None = Field(None, gt=0)
    num_heads: int | None = Field(None, gt=0)
    mlp_ratio: float = Field(4.0, gt=0)


class MLPModel(_Model):
    arch: Literal["mlp"] = "mlp"
    hidden: int = Field(256, gt=0)
    depth: int | None = Field(None, gt=0)


class RouterModel(_Model):
    """A classifier of noised examples into `outputs` clusters: a small DiT encoder for images (hidden_size,
    num_heads, patch_size), a residual MLP for vectors (hidden)."""

    arch: Literal["router"] = "router"
    outputs: int = Field(2, gt=1)
    depth: int | None = Field(None, gt=0)
    hidden: int = Field(256, gt=0)
    hidden_size: int | None = Field(None, gt=0)
    num_heads: int | None = Field(None, gt=0)
    patch_size: int = Field(2, gt=0)


class AutoencoderKLModel(_Model):
    """diffusers' AutoencoderKL trained by `train.objective: autoencoder` (SD's VAE: block_out_channels 128, 256,
    512, 512, layers_per_block 2), and its loss: the pixel term, an L1 on Sobel gradients in place of a perceptual
    loss (which needs pretrained weights), and the KL term, each a mean over pixels (SD's weights per pixel)."""

    arch: Literal["autoencoder_kl"] = "autoencoder_kl"
    block_out_channels: list[Annotated[int, Field(gt=0)]] = [32, 64, 64]  # one block per entry; 2^(n-1) downsampling
    latent_channels: int = Field(4, gt=0)
    layers_per_block: int = Field(1, gt=0)
    norm_num_groups: int = Field(32, gt=0)
    mid_block_attention: bool = True
    pixel_loss: Literal["l1", "l2"] = "l1"
    sobel_weight: float = Field(0.5, ge=0)
    kl_weight: float = Field(1e-6, ge=0)  # SD's VAE: 1e-6 of the KL summed over the latent per pixel summed

    @model_validator(mode="after")
    def _check(self):
        if not self.block_out_channels:
            raise ValueError("block_out_channels: give at least one width")
        if self.num_classes:
            raise ValueError(f"num_classes: an autoencoder is not conditioned on a class (got {self.num_classes})")
        return self


class DiffusersModel(_Model):
    """A diffusers denoiser (islands/nets/diffusers_net.py): `class_name` built from `config`, its constructor's
    arguments (those the data decides, its channels and size, filled in where left out); or the network of the local
    diffusers folder `pretrained` (config.json and diffusion_pytorch_model.safetensors), whose class and config are
    read from the folder here and whose weights a new run starts from."""

    arch: Literal["diffusers"] = "diffusers"
    class_name: Literal[DIFFUSERS_CLASSES] | None = None
    config: dict[str, Any] = {}
    pretrained: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.pretrained is None and self.class_name is None:
            raise ValueError(f"class_name: give the diffusers class ({', '.join(DIFFUSERS_CLASSES)}) and its "
                             "model.config, or a diffusers folder as model.pretrained")
        return self

    def resolve(self) -> None:
        """The pretrained folder's class and config, read from its config.json (its weights when the run starts)."""
        if self.pretrained is None:
            return
        from islands.nets.vae_folder import read_config

        try:
            config = read_config(self.pretrained, "diffusers folder", DIFFUSERS_CLASSES)
        except ValueError as err:
            raise ValueError(f"pretrained: {err}") from None
        # a resolved config names both (read from the folder); given by hand, they must say what the folder says
        folder_config = {k: v for k, v in config.items() if not k.startswith("_")}
        if self.class_name not in (None, config["_class_name"]):
            raise ValueError(f"class_name: {self.class_name}, but model.pretrained {self.pretrained} holds a "
                             f"{config['_class_name']}; leave class_name out, the folder names its class")
        if self.config and self.config != folder_config:
            raise ValueError("config: a pretrained network's config is its folder's config.json; leave it out")
        self.class_name, self.config = config["_class_name"], folder_config


ModelConfig = Annotated[UNetModel | DiTModel | MLPModel | RouterModel | AutoencoderKLModel | DiffusersModel,
                        Field(discriminator="arch")]


# --- flow: continuous paths, and DDPM's discrete schedule with its own keys ---

class _Flow(Section):
    prediction: Literal["velocity", "epsilon", "x0"] = "velocity"
    # None: logit_normal for images (Esser et al. 2024), uniform for vector data (model.arch mlp), where the mode
    # weights are decided near t = 1 and logit-normal rarely trains there (docs/BENCHMARKS.md, mode_weights).
    # vp_discrete: rounded down to a step.
    time_sampler: Literal["uniform", "logit_normal"] | None = None
    logit_mean: float = 0.0
    logit_std: float = Field(1.0, gt=0)
    t_range: tuple[float, float] = (0.0, 1.0)  # in the path's own time: a timestep-range expert's share
    # Timestep-range experts: boundaries in canonical t from 0 to 1; `islands train CONFIG tstage=I` trains expert I
    # on [t_ranges[I], t_ranges[I + 1]] (its t_range, in the path's own time), and `islands sample` gates them by t.
    t_ranges: list[float] | None = None
    # SD3's resolution shift of the training times (Esser et al. 2024, eq. 23): t -> a t / (1 + (a - 1) t), for
    # images of a times the side of those the schedule suits (a run continued at 28x28 from one at 14x14: 2); the
    # samples of the run shift their time grid alike (sample.time_shift). 1: no shift.
    time_shift: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _check_range(self):
        lo, hi = self.t_range
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"t_range: must satisfy 0 <= lo < hi <= 1, got {list(self.t_range)}")
        _check_boundaries(self.t_ranges)
        if self.time_shift != 1 and self.path != "rectified_flow":  # the training times are the path's own
            raise ValueError(f"time_shift: SD3's shift is defined on rectified-flow time, not on {self.path!r}'s own")
        return self

    def path_options(self) -> dict:
        """What `build_path` takes beside the path's name."""
        return {}


class ContinuousFlow(_Flow):
    path: Literal["rectified_flow", "vp_linear", "cosine"] = "rectified_flow"


class DiscreteFlow(_Flow):
    """DDPM's schedule of `train_steps` steps, its betas linear (1e-4 to 0.02) or cosine."""

    path: Literal["vp_discrete"] = "vp_discrete"
    beta_schedule: Literal["linear", "cosine"] = "linear"
    train_steps: int = Field(1000, gt=1)

    @model_validator(mode="after")
    def _check_steps(self):
        if self.prediction == "velocity":  # its training times are exactly the kinks of its alpha
            raise ValueError("prediction: 'velocity' is not defined on the steps of 'vp_discrete'; use epsilon or x0")
        lo, hi = self.t_range
        if math.ceil(lo * self.train_steps - 1e-9) >= math.ceil(hi * self.train_steps - 1e-9):
            raise ValueError(f"t_range: {list(self.t_range)} holds none of the steps n / {self.train_steps}")
        return self

    def path_options(self) -> dict:
        return {"beta_schedule": self.beta_schedule, "train_steps": self.train_steps}


FlowConfig = Annotated[ContinuousFlow | DiscreteFlow, Field(discriminator="path")]



def _keys_by_kind(tag: str, *variants) -> dict[str, set[str]]:
    """{kind: the keys its variant takes} for every value of the variants' `tag`."""
    return {kind: set(cls.model_fields) for cls in variants for kind in get_args(cls.model_fields[tag].annotation)}


# Sections with variants: the key that tells them apart, its default, and the keys each kind takes.
VARIANTS = {
    "data": ("source", "mnist5k", _keys_by_kind("source", Mnist5kData, FashionMnistData, FolderData, HfData,
                                                 EmojiData, NpzData, ShardsData, GMMData)),
    "model": ("arch", "unet", _keys_by_kind("arch", UNetModel, DiTModel, MLPModel, RouterModel, AutoencoderKLModel,
                                             DiffusersModel)),
    "flow": ("path", "rectified_flow", _keys_by_kind("path", ContinuousFlow, DiscreteFlow)),
}


class TrainConfig(Section):
    images: int = Field(10_000, gt=0)  # run length, counted in training images
    batch_size: int = Field(64, gt=0)  # the global batch, whatever the number of ranks
    accumulate: int = Field(1, gt=0)  # micro-batches per optimizer step
    lr: float = Field(2e-4, gt=0)
    warmup_images: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    optimizer: Literal["adamw", "sgd"] = "adamw"  # sgd: plain, without momentum (betas unused)
    grad_clip: float = Field(1.0, ge=0)  # 0: no clipping
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each block (a cold start of about a minute; faster steps after it)
    # EDM's 500k images and ramp-up (Karras et al. 2022): a run shorter than 10M images averages over its last 5%.
    ema_halflife_images: float = Field(500_000.0, ge=0)  # 0: no EMA
    ema_rampup: float | None = Field(0.05, gt=0)  # half-life <= rampup * images seen (EDM)
    label_dropout: float = Field(0.1, ge=0, lt=1)  # share of labels replaced by "none" for guidance
    checkpoint_every: int = Field(5_000, gt=0)
    keep_checkpoints: int = Field(2, gt=0)
    sample_every: int = Field(0, ge=0)  # 0: one grid at the end only
    log_every: int = Field(1_000, gt=0)
    max_nonfinite: int = Field(5, gt=0)  # consecutive skipped steps before the run stops
    threads: int | None = Field(None, gt=0)  # torch intra-op threads; None leaves torch's default
    # router: classify noised examples by cluster; distill: learn an ensemble's velocity (data.partition names the
    # ensemble); autoencoder: reconstruct the data through the latent of model.arch autoencoder_kl
    objective: Literal["diffusion", "router", "distill", "autoencoder"] = "diffusion"
    teacher: Literal["cluster", "full"] = "cluster"  # distill: the expert of each image's cluster, or the mixture
    # A run whose latest weights (its EMA, if any) start this one, instead of a random initialisation: eDiff-I's
    # recipe for timestep-range experts (train one model on all t, then fine-tune a copy on each range).
    init_from: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.batch_size % self.accumulate:
            raise ValueError(f"batch_size: {self.batch_size} is not divisible by accumulate={self.accumulate}")
        if self.images < self.batch_size:  # the run would take one whole batch anyway, more than it was told
            raise ValueError(f"images: {self.images} is fewer than one batch (train.batch_size={self.batch_size})")
        return self


class SampleConfig(Section):
    num: int = Field(64, gt=0)
    steps: int = Field(32, gt=0)
    solver: Literal["euler", "heun", "dpm2m", "unipc"] = "heun"
    grid: Literal["uniform", "edm", "shifted", "logsnr"] = "uniform"
    guidance: float = Field(1.0, ge=0)
    batch_size: int = Field(256, gt=0)
    # bf16: the networks' matmuls under autocast, the ODE in fp32; auto: bf16 where the run trained in bf16 and the
    # sampling device computes bf16 natively, else fp32 (resolved by generate.run_sample_options)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # SD3's resolution shift of the time grid (islands.flow.timesteps.shift_time); None: the run's flow.time_shift
    time_shift: float | None = Field(None, gt=0)


# The fewest samples a metric is computed from: KID's standard error needs 4; precision/recall's radius is each
# sample's distance to its 3rd nearest other sample; a covariance (FD) needs 2.
MIN_SAMPLES = {"kid": 4, "precision_recall": 4, "fd": 2}


class EvalConfig(Section):
    every: int = Field(0, ge=0)  # images between evaluations during training; 0: none (use `islands eval`)
    num: int = Field(1000, gt=0)  # samples generated per evaluation
    metrics: list[str] | None = None  # None: every metric that applies to the data
    # None: the prompt judge's image features for captioned images, a classifier for labelled ones, else pixels
    features: Literal["classifier", "pixels", "torch", "contrastive"] | None = None
    feature_net: str | None = None  # torch features: 'package.module:function' building the network
    feature_weights: str | None = None  # torch features: its weights, a safetensors file
    feature_size: int | None = Field(None, gt=0)  # torch features: resize images to this side first
    feature_channels: int | None = Field(None, gt=0)  # torch features: repeat grey images to this many channels
    classifier_epochs: int = Field(2, gt=0)
    # prompt following of text-conditioned runs: None, Islands' contrastive judge; or a user's CLIP folder
    prompt_judge: str | None = None
    judge_epochs: int = Field(30, gt=0)  # training length of Islands' judge (cached under it)
    val_size: int = Field(256, ge=0)  # examples of the fixed validation probe; 0: no validation loss
    val_times: int = Field(8, gt=0)  # stratified times t = (k + 0.5) / val_times at which each is scored

    @model_validator(mode="after")
    def _check_num(self):
        """Refused here, not after training: a run's evaluations need enough samples for the metrics they compute."""
        asked = self.metrics if self.metrics is not None else list(MIN_SAMPLES)  # None: every metric that applies
        short = [m for m in asked if self.num < MIN_SAMPLES.get(m, 1)]
        if short:
            fewest = max(MIN_SAMPLES[m] for m in short)
            raise ValueError(f"num: {self.num} samples are too few for {', '.join(short)} (at least {fewest})")
        return self


class PartitionConfig(Section):
    method: Literal["kmeans", "random", "label"] = "kmeans"  # label: the oracle by class, for comparison
    # torch: as eval.feature_net/weights; text: each example's caption's pooled embedding (model.condition text);
    # both: pixels and text, each block standardised. None: text for a text-conditioned run (the only pretrained
    # semantic features Islands has offline; the condition router's top-1 is 97% on a text partition against 72% on
    # a pixel one, BENCHMARKS.md section 26), pixels otherwise; resolved so that the config records it.
    features: Literal["pixels", "classifier", "torch", "text", "both"] | None = None
    pca_dim: int | None = Field(64, gt=0)  # None: cluster the features as they are
    fine: int = Field(1024, gt=1)  # fine k-means centroids, then K coarse clusters over them
    balanced: bool = True


class RouterConfig(Section):
    hidden_size: int = Field(128, gt=0)  # images: a small DiT encoder
    depth: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    patch_size: int = Field(4, gt=0)
    # vectors: a residual MLP; None: a quarter of the experts' width. Under a FLOP budget a narrow router sees more
    # images: on a 2-D mixture, width 32 beside experts of 128 halved its error against the exact posterior and
    # took full routing's mode-mass error from 2.6x to 2.0x ancestral routing's (BENCHMARKS.md section 11).
    hidden: int | None = Field(None, gt=0)
    # The router's budget: its training FLOPs as a share of the experts' (the paper's 4%), counted the way every
    # run's flops.json is; `images` fixes its run length instead.
    flops_fraction: float = Field(0.04, gt=0)
    images: int | None = Field(None, gt=0)
    # EMA of the router's weights, its half-life a share of the router's images (no ramp-up). Without it a router
    # trained at a constant rate ends on noisy weights: on a 2-D mixture full routing's mode-mass error fell from
    # 0.055 to 0.024 (ancestral: 0.019).
    ema_fraction: float = Field(0.1, ge=0)
    batch_size: int = Field(64, gt=0)
    lr: float = Field(5e-4, gt=0)

    @model_validator(mode="after")
    def _check(self):
        if self.images is not None and self.images < self.batch_size:
            raise ValueError(f"images: {self.images} is fewer than one batch (ddm.router.batch_size={self.batch_size})")
        return self


class DDMConfig(Section):
    k: int = Field(0, ge=0)  # experts; 0: not a decentralized run
    partition: PartitionConfig = PartitionConfig()
    router: RouterConfig = RouterConfig()
    expert_batch: int | None = Field(None, gt=0)  # None: compute parity, train.batch_size / k
    monolith: bool = False  # `islands ddm` also trains the plain model of this config and compares the two
    # A cluster x range grid: each cluster's expert is split into timestep-range experts at these boundaries
    # (canonical t), K x R runs in ENSEMBLE/experts/<k>/tstages/<r>; the router gates clusters, t gates ranges.
    t_ranges: list[float] | None = None

    @model_validator(mode="after")
    def _check(self):
        _check_boundaries(self.t_ranges)
        return self


@dataclass(frozen=True)
class StrategyKind:
    """What a config must know of a parallel strategy; its class reads its own keys (`Strategy.options`)."""
    path: str | None  # its class, "module.Class" under islands/parallel, imported only when chosen (build_strategy)
    local_updates: bool = False  # replicas that drift apart between synchronisations


# parallel.strategy: the one place its names are listed; the schema, the config's checks, build_strategy and the
# plan's local strategies read them here. tstages has no class: the ranks split into one group per range of
# flow.t_ranges, each training its range with ddp inside it (trainer/loop.range_of_this_rank).
STRATEGIES = {
    "none": StrategyKind("strategies.Strategy"),
    "ddp": StrategyKind("strategies.DDPStrategy"),
    "zero1": StrategyKind("sharding.Zero1Strategy"),
    "zero2": StrategyKind("sharding.Zero2Strategy"),
    "fsdp": StrategyKind("sharding.FSDPStrategy"),
    "tstages": StrategyKind(None),
    "pipeline": StrategyKind("pipeline.PipelineStrategy"),  # the network cut into stages on different ranks
    "local_sgd": StrategyKind("local_updates.LocalSGDStrategy", local_updates=True),
    "diloco": StrategyKind("local_updates.DiLoCoStrategy", local_updates=True),
}
LOCAL_UPDATES = tuple(name for name, kind in STRATEGIES.items() if kind.local_updates)


class ParallelConfig(Section):
    # Keys of every strategy side by side, as users write them; each strategy's class reads its own.
    strategy: Literal[tuple(STRATEGIES)] = "none"
    timeout_s: float = Field(600.0, gt=0)  # a collective that waits longer fails every rank
    compression: Literal["none", "fp16", "bf16"] = "none"  # precision of gradient reduction on the wire
    stages: int = Field(2, ge=1)  # pipeline: ranks per pipeline
    microbatches: int = Field(4, ge=1)  # pipeline: pieces of each rank's batch that flow through the stages
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"  # pipeline: torch.distributed.pipelining's schedule
    virtual_stages: int = Field(1, ge=1)  # interleaved: stages per rank (the network is cut into stages x V)
    data: int | None = Field(None, ge=1)  # pipeline: data-parallel copies of the pipeline; None: world / stages
    # local_sgd, diloco: the replicas (one per rank) synchronise every sync_every optimizer steps
    sync_every: int = Field(100, ge=1)
    outer_lr: float = Field(0.7, gt=0)  # diloco: the outer Nesterov SGD step on the averaged parameter change
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    fragments: int = Field(1, ge=1)  # streaming: the parameters in F fragments that synchronise in turn
    # local_sgd, diloco: candidates for closing the gap to data parallelism (issue 40), all off by default
    warm_start_images: int = Field(0, ge=0)  # the steps begun before image N data parallel; the rounds begin after
    sync_every_start: int | None = Field(None, ge=1)  # H0: H grows linearly from it to sync_every (whole syncs)
    sync_every_ramp_images: int | None = Field(None, ge=1)  # images over which H grows to sync_every; None: the run
    overlap_steps: int = Field(0, ge=0)  # tau: an exchange lands tau steps after it began (Streaming DiLoCo)
    mixing: float = Field(0.0, ge=0, lt=1)  # alpha: where one lands, local <- alpha local + (1 - alpha) synchronised
    inner_state: Literal["keep", "reset"] = "keep"  # the inner optimizer's state at a synchronisation: kept or zeroed
    outer_ema: Literal["anchor", "mean"] = "anchor"  # diloco: the EMA takes in the outer weights or the replicas' mean
    # islands of islands: R groups of ranks, each one replica trained by `inner` every step; None: one per rank
    replicas: int | None = Field(None, ge=1)
    inner: Literal["ddp"] = "ddp"
    # heterogeneous replicas, one entry each: images per step (summing to train.batch_size), peak learning rate,
    # optimizer steps per synchronisation; averaging weighs each by the images it consumed since the last one
    worker_batch: list[Annotated[int, Field(ge=1)]] | None = None
    worker_lr: list[Annotated[float, Field(ge=0)]] | None = None
    worker_sync_every: list[Annotated[int, Field(ge=1)]] | None = None
    # replicas that are separate jobs and may drop out and rejoin (torchft): the lighthouse's address, which of
    # `replicas` this job is, the address its peers reach it at (default: this machine's name), the fewest
    # replicas a synchronisation may go ahead with, and how long a replica waits at a synchronisation for a live
    # peer to reach it (a peer that stops heartbeating is left out sooner, by the lighthouse)
    lighthouse: str | None = None
    replica_id: int | None = Field(None, ge=0)
    host: str | None = None
    min_replicas: int = Field(1, ge=1)
    quorum_timeout_s: float = Field(3600.0, gt=0)

    @model_validator(mode="after")
    def _check(self):
        if self.lighthouse is not None:
            if not STRATEGIES[self.strategy].local_updates:
                raise ValueError(f"lighthouse: replicas joined through torchft are local_sgd or diloco replicas, "
                                 f"not {self.strategy!r}")
            if self.replicas is None or self.replica_id is None:
                raise ValueError("lighthouse: give parallel.replicas (how many replica jobs) and parallel.replica_id "
                                 "(which one this job is)")
            if self.replica_id >= self.replicas:
                raise ValueError(f"replica_id: {self.replica_id} is not one of parallel.replicas={self.replicas} "
                                 "(0 to replicas - 1)")
            if self.min_replicas > self.replicas:
                raise ValueError(f"min_replicas: {self.min_replicas} is more than parallel.replicas={self.replicas}")
        elif self.replica_id is not None:
            raise ValueError("replica_id: only replicas joined through parallel.lighthouse have an id")
        self._check_local_candidates()
        if (self.schedule == "interleaved") != (self.virtual_stages > 1):
            raise ValueError("virtual_stages: the interleaved schedule needs virtual_stages >= 2, "
                             f"and only it has virtual stages (schedule={self.schedule!r})")
        return self

    def _check_local_candidates(self) -> None:
        """What the local updates' candidates (warm start, growing H, overlap) cannot be combined with."""
        shortest = self.sync_every_start or self.sync_every
        if self.sync_every_start is not None:
            if self.sync_every_start > self.sync_every:
                raise ValueError(f"sync_every_start: {self.sync_every_start} is more than sync_every="
                                 f"{self.sync_every}, which H grows to")
            if self.fragments > 1 or self.worker_sync_every is not None:
                raise ValueError("sync_every_start: a growing H is offered for whole synchronisations of alike "
                                 "replicas only (fragments=1, no worker_sync_every)")
        elif self.sync_every_ramp_images is not None:
            raise ValueError("sync_every_ramp_images: H grows only from parallel.sync_every_start, which is not given")
        if self.overlap_steps >= shortest:
            raise ValueError(f"overlap_steps: {self.overlap_steps} steps is not less than the {shortest} steps "
                             "between a fragment's exchanges (its result must land before its next exchange)")
        if self.warm_start_images and (self.worker_batch or self.worker_lr or self.worker_sync_every):
            raise ValueError("warm_start_images: the data-parallel warm start needs alike replicas (no worker_batch, "
                             "worker_lr or worker_sync_every)")
        if self.lighthouse is not None:
            given = [k for k, off in (("warm_start_images", 0), ("sync_every_start", None), ("overlap_steps", 0),
                                      ("mixing", 0.0)) if getattr(self, k) != off]
            if given:
                raise ValueError(f"{given[0]}: not offered with parallel.lighthouse (replicas that are separate jobs "
                                 "synchronise whole, every sync_every steps, at once)")


class Config(Section):
    run_dir: str
    seed: int = 0
    data: DataConfig = Field(default_factory=Mnist5kData)
    model: ModelConfig = Field(default_factory=UNetModel)
    flow: FlowConfig = Field(default_factory=ContinuousFlow)
    train: TrainConfig = TrainConfig()
    sample: SampleConfig = SampleConfig()
    parallel: ParallelConfig = ParallelConfig()
    eval: EvalConfig = EvalConfig()
    ddm: DDMConfig = DDMConfig()

    @field_validator("run_dir")
    @classmethod
    def _a_folder(cls, run_dir: str) -> str:
        """A file where the run's folder (or a folder above it) would go stops the run at its first write."""
        path = Path(run_dir)
        existing = next((p for p in (path, *path.parents) if p.exists()), path)
        if existing.exists() and not existing.is_dir():
            raise ValueError(f"{'names a file' if existing == path else f'{existing} is a file'}, not a folder")
        return run_dir

    @model_validator(mode="before")
    @classmethod
    def _default_kinds(cls, raw):
        """A section that does not say its kind has the default one (a U-Net, MNIST 5k, rectified flow)."""
        if isinstance(raw, dict):
            for section, (tag, default, _) in VARIANTS.items():
                if isinstance(raw.get(section), dict) and tag not in raw[section]:
                    raw = {**raw, section: {**raw[section], tag: default}}
        return raw

    @model_validator(mode="after")
    def _defaults_by_kind(self):
        """Defaults that depend on another section, filled in so that the resolved config states them."""
        if self.flow.time_sampler is None:
            self.flow.time_sampler = "uniform" if self.model.arch == "mlp" else "logit_normal"
        if self.sample.time_shift is None:  # samples move their times as the training times were moved
            self.sample.time_shift = self.flow.time_shift
        if self.model.arch == "diffusers" and getattr(self.flow, "train_steps", 1000) != 1000:
            raise ValueError(f"flow.train_steps: a diffusers network takes DDPM's timesteps 0-999 (1000 tau); "
                             f"{self.flow.train_steps} steps would feed it other ones")
        return self

    def resolve(self) -> "Config":
        """What the folders the config names say, filled in once it is valid (validation itself reads no file): a
        pretrained network's class and config; the condition, where none is given (a class with num_classes, else a
        caption where the data has captions and the network reads them), checked by its kind
        (islands/conditions/), which fills in what its network needs from its folders (a text encoder's widths);
        and the features an ensemble clusters by default. Raises ValueError naming the key."""
        from islands.conditions import KINDS  # the kinds' rules are theirs; they read this module's sections

        model = self.model
        if model.arch == "diffusers":
            try:
                model.resolve()
            except ValueError as err:
                raise ValueError(f"model.{err}") from None
        if model.condition is None:
            model.condition = ("class" if model.num_classes else
                               "text" if reads_text(model) and captioned(self.data) else "none")
        kind = KINDS[model.condition]
        kind.check(self)
        kind.resolve(self)
        if self.ddm.partition.features is None:
            self.ddm.partition.features = kind.partition_features
        return self

    @model_validator(mode="after")
    def _autoencoder(self):
        """An autoencoder is trained by its own objective, and that objective trains nothing else."""
        if (self.train.objective == "autoencoder") != (self.model.arch == "autoencoder_kl"):
            raise ValueError(f"train.objective: {self.train.objective!r} does not train model.arch "
                             f"{self.model.arch!r}; an autoencoder_kl is trained by objective 'autoencoder' only")
        # a router and a distilled student learn from noised latents as the experts do
        if self.data.autoencoder is not None and (self.train.objective == "autoencoder" or self.data.source == "gmm"):
            raise ValueError("data.autoencoder: latents are for diffusion models of images and their routers "
                             f"(train.objective {self.train.objective!r}, data.source {self.data.source!r})")
        return self

    @model_validator(mode="after")
    def _workers(self):
        """Heterogeneous replicas are local-update replicas; their batches make up the global batch."""
        par = self.parallel
        for key in ("worker_batch", "worker_lr", "worker_sync_every", "shards"):
            given = getattr(self.data if key == "shards" else par, key)
            if given is not None and not STRATEGIES[par.strategy].local_updates:
                raise ValueError(f"{'data' if key == 'shards' else 'parallel'}.{key}: replicas that differ are "
                                 f"local_sgd or diloco replicas, not {par.strategy!r}")
        if par.worker_sync_every is not None and par.fragments > 1:
            raise ValueError("parallel.worker_sync_every: streamed fragments take turns on one common period; "
                             "give parallel.fragments=1 or drop worker_sync_every")
        if self.data.shards is not None and self.data.partition is not None:
            raise ValueError("data.shards: the replicas' shards replace data.partition; give one of them")
        if par.worker_batch is not None:
            total = sum(par.worker_batch)
            if "batch_size" not in self.train.model_fields_set:
                self.train = self.train.model_copy(update={"batch_size": total})
            elif self.train.batch_size != total:
                raise ValueError(f"train.batch_size: {self.train.batch_size} is not the sum of parallel.worker_batch "
                                 f"{par.worker_batch} ({total})")
        return self


# Keys a resume may change: they alter how long, how often, on how many ranks and in how many micro-batches,
# not what is computed (accumulate only reorders float sums, which lets a run move to fewer devices). Of `parallel`,
# only the layout: the pipeline's cut, how replicas find each other and how long they wait, and (`_resumable`) a
# move between the strategies that compute every step alike (resumes across them are tested bit for bit). Local
# updates' keys (H, the outer step, fragments, replicas, their batches and rates), the wire's precision and which
# replica a job is change what is computed: they stay as the run began.
RESUMABLE_CHANGES = {
    "run_dir", "train.images", "train.accumulate", "train.checkpoint_every", "train.keep_checkpoints",
    "train.sample_every", "train.log_every", "train.max_nonfinite", "train.threads", "train.compile", "data.workers",
    "data.check", "sample", "eval",
    "parallel.timeout_s", "parallel.stages", "parallel.microbatches", "parallel.schedule",
    "parallel.virtual_stages", "parallel.data", "parallel.lighthouse", "parallel.host", "parallel.min_replicas",
    "parallel.quorum_timeout_s",
}


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc, kind = list(e["loc"]), None
    if len(loc) > 1 and loc[0] in VARIANTS and loc[1] in VARIANTS[loc[0]][2]:
        kind = loc.pop(1)  # pydantic names the variant it tried: say which key, and of which kind
    key = ".".join(str(p) for p in loc)
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "union_tag_invalid":
        tag, _, kinds = VARIANTS[loc[0]]
        return f"{loc[0]}.{tag}: must be one of {', '.join(map(repr, kinds))} (got {e['input'].get(tag)!r})"
    if e["type"] == "extra_forbidden" and kind is not None:
        tag, _, kinds = VARIANTS[loc[0]]
        used = any(loc[-1] in keys for keys in kinds.values())
        msg = f"not used when {tag} is {kind!r}" if used else "unknown key"
    elif e["type"] == "extra_forbidden":
        msg = "unknown key"
    elif e["type"] == "missing":
        msg = "required key is missing"
    elif "input" in e and not isinstance(e["input"], dict):
        msg += f" (got {e['input']!r})"
    if e["type"] == "value_error" and ": " in msg:  # a section's own check names its key first
        return f"{key}.{msg}" if key else msg
    return f"{key}: {msg}" if key else msg


def parse_override(item: str) -> tuple[list[str], object]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        value = text
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for item in overrides:
        keys, value = parse_override(item)
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(keys)}: '{k}' is not a section")
        node[keys[-1]] = value
    return raw


def validate(raw: dict) -> Config:
    """The config `raw` describes, validated (no file read), then resolved from the folders it names."""
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    try:
        return cfg.resolve()
    except ValueError as err:
        raise ConfigError(str(err)) from None


def revalidate(section: Section, name: str, **updates) -> Section:
    """A section with some keys replaced (e.g. from command-line options), checked again."""
    try:
        return type(section).model_validate({**section.model_dump(exclude_unset=True), **updates})
    except ValidationError as err:
        raise ConfigError(f"{name}.{_format_error(err)}") from None


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections")
    return validate(apply_overrides(raw, list(overrides)))


def to_dict(cfg: Config) -> dict:
    """The resolved config: every key the run uses, with its value (a variant holds only its own kind's keys)."""
    return cfg.model_dump(mode="json")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# Partition folders, which `islands ddm` keeps in the ensemble beside the runs that read them: spelled relative under
# `islands ddm`, absolute in its emitted scripts, under another mount on another island. The same place seen from
# the run's own folder is the same partition (a config's run_dir is spelled the same way as its partition).
BESIDE_THE_RUN = ("data.partition", "data.shards")


def _same_folder(a: dict, b: dict, key: str) -> bool:
    """Whether `key` names the same folder in both flattened configs, as written or relative to their run_dir."""
    x, y = a.get(key), b.get(key)
    if x is None or y is None or x == y:
        return x == y
    return os.path.relpath(x, a["run_dir"]) == os.path.relpath(y, b["run_dir"])


def _resumable(a: dict, b: dict, key: str) -> bool:
    """Whether a resume may change `key` from its value in `a` to the one in `b` (flattened configs)."""
    if key == "parallel.strategy":  # between strategies that compute every step alike, not into or out of local updates
        return not {a.get(key), b.get(key)} & set(LOCAL_UPDATES)
    if key in BESIDE_THE_RUN:
        return _same_folder(a, b, key)
    return key in RESUMABLE_CHANGES or key.split(".")[0] in RESUMABLE_CHANGES


_NO_DEFAULT = object()


def _default_of(key: str):
    """The schema's default of a dotted key (`parallel.mixing`), or _NO_DEFAULT where it has none."""
    model, *names, last = Config, *key.split(".")
    for name in names:  # sections of one model each (a union, as `data` is, has no one default)
        model = getattr(model.model_fields.get(name), "annotation", None)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return _NO_DEFAULT
    field = model.model_fields.get(last)
    return _NO_DEFAULT if field is None or field.is_required() else field.get_default(call_default_factory=True)


def _as_written_now(old: dict, keys) -> dict:
    """A config written by an older Islands as this one reads it (flattened): the keys it lacks at the values the
    validators give them (a default may follow from other keys: `data.order` from whether `data.path` is a URL), or
    at the schema's defaults where it no longer validates."""
    try:
        return flatten(to_dict(validate(old)))
    except (ConfigError, ValueError, OSError):
        return {key: value for key in keys if (value := _default_of(key)) is not _NO_DEFAULT}


def trajectory_changes(old: dict, new: dict) -> list[str]:
    """Keys whose change would make a resumed run differ from the one on disk. A key the run's config lacks (written
    by an Islands that did not have it yet) is taken as this Islands reads that config: a run resumes after an
    upgrade."""
    a, b = flatten(old), flatten(new)
    if set(b) - set(a):
        a = {**_as_written_now(old, set(b) - set(a)), **a}
    return [f"{key}: {a.get(key)!r} -> {b.get(key)!r}" for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key) and not _resumable(a, b, key)]

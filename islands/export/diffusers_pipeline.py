"""An Islands ensemble (a Decentralized Diffusion Model) sampled with plain diffusers.

`islands export ENSEMBLE OUT/` copies this file into OUT/ as pipeline.py. It imports nothing of Islands (torch,
diffusers and safetensors are all it needs), so whoever receives the folder samples it without installing Islands:

    spec = importlib.util.spec_from_file_location("ddm_pipeline", "OUT/pipeline.py")
    ddm_pipeline = importlib.util.module_from_spec(spec); spec.loader.exec_module(ddm_pipeline)
    pipe = ddm_pipeline.DDMPipeline.from_folder("OUT")
    images = pipe(8, class_labels=torch.arange(8) % 4, routing="topk:2", num_inference_steps=32, guidance_scale=2)

The folder, in the layout of the open DDM checkpoints: expert_N/ (each expert as its own diffusers class,
config.json and diffusion_pytorch_model.safetensors; a text-conditioned one also islands_null_caption.safetensors,
the learned "no caption" it was trained with, as its forward takes a caption), router/ (`DDMRouter` below),
scheduler/ (FlowMatchEulerDiscreteScheduler), partition/ (the clusters' sizes, their shares per class, the
centroids), condition_router/ on text (p(cluster | caption)), and ddm.json, which names all of them with each file's
sha256. Every file is checked against it when read and deserialised from the bytes that were hashed, as safetensors:
nothing is unpickled and no class is built that is not on EXPERT_CLASSES.

The experts were trained on the clusters of one partition; the velocity of the whole data set is
u(x_t, t) = sum_k p(k | x_t, t) u_k(x_t, t) (McAllister et al. 2025, arXiv 2501.05450), with the router's
p(k | x_t, t). A routing policy picks the experts each sample evaluates (ROUTINGS); classifier-free guidance runs
inside each expert, weighted by the conditional call's routing. Times are the rectified-flow sigma: x_t = (1 - t) x0
+ t eps, sampled with Euler steps from t = 1 to 0, as `islands sample --solver euler` samples.
"""

import hashlib
import json
import math
from pathlib import Path

import diffusers
import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from safetensors.torch import load as safetensors_load
from torch import nn

EXPERT_CLASSES = ("UNet2DModel", "UNet2DConditionModel", "DiTTransformer2DModel", "SD3Transformer2DModel",
                  "FluxTransformer2DModel")
# Islands' own networks, whose code ships in the folder's islands_networks/ (its files checked like the weights)
OWN_CLASSES = ("IslandsUNet", "IslandsDiT")
PACKAGE = "islands_networks"
ROUTINGS = ("ancestral", "full", "top1", "topk:K", "nucleus:P", "sample", "ancestral_then:topk:K@T")
INDEX = "ddm.json"
NULL_CAPTION = "islands_null_caption.safetensors"


# --- reading the folder --------------------------------------------------------------------------------------------

def read_verified(root: Path, relative: str, sha256: str) -> bytes:
    """The bytes of root/relative, which must lie inside root and hash to `sha256`."""
    path = (root / relative).resolve()
    if Path(relative).is_absolute() or not path.is_relative_to(root.resolve()):
        raise ValueError(f"{root / INDEX}: {relative} lies outside {root}")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{root / relative}: sha256 does not match {INDEX}")
    return data


def load_component(root: Path, files: dict, folder: str, cls):
    """A model saved as a diffusers folder (config.json and diffusion_pytorch_model.safetensors), both checked."""
    config = json.loads(read_verified(root, f"{folder}/config.json", files[f"{folder}/config.json"]))
    weights_name = f"{folder}/diffusion_pytorch_model.safetensors"
    model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    model.load_state_dict(safetensors_load(read_verified(root, weights_name, files[weights_name])))
    return model.eval()


def own_networks(root: Path, files: dict):
    """The folder's islands_networks package, every file of it checked against the index before it is imported."""
    import importlib.util
    import sys

    shipped = sorted(name for name in files if name.startswith(f"{PACKAGE}/"))
    for name in shipped:
        read_verified(root, name, files[name])
    if f"{PACKAGE}/__init__.py" not in shipped:
        raise ValueError(f"{root / INDEX}: lists no {PACKAGE}/__init__.py for its Islands networks")
    spec = importlib.util.spec_from_file_location(PACKAGE, root / PACKAGE / "__init__.py",
                                                  submodule_search_locations=[str(root / PACKAGE)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module  # its files import each other relatively
    spec.loader.exec_module(module)
    return module


# --- the router: Islands' TransformerRouter, its weights under the same names ------------------------------------

def sincos_2d(grid: int, dim: int) -> torch.Tensor:
    """(grid * grid, dim) fixed positions, half the features for the column, half for the row (MAE, DiT)."""
    def sincos_1d(pos, width):
        omega = 1.0 / 10000 ** (torch.arange(width // 2, dtype=torch.float64) / (width // 2))
        args = pos.double()[:, None] * omega[None]
        return torch.cat([torch.sin(args), torch.cos(args)], dim=1)

    rows, cols = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                                indexing="ij")
    return torch.cat([sincos_1d(cols.flatten(), dim // 2), sincos_1d(rows.flatten(), dim // 2)], dim=1).float()


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoids of 1000 t (Vaswani et al. 2017, Sec. 3.5), cosines first."""
    freqs = torch.exp(-math.log(10000) * torch.arange(dim // 2, dtype=torch.float32, device=t.device) / (dim // 2))
    args = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class _Attention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class _Block(nn.Module):
    """DiT's block with adaLN-Zero (Peebles & Xie 2023, Sec. 3.2)."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = _Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x, c):
        shift1, scale1, gate1, shift2, scale2, gate2 = (m.unsqueeze(1) for m in self.adaLN_modulation(c).chunk(6, 1))
        x = x + gate1 * self.attn(self.norm1(x) * (1 + scale1) + shift1)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class _Label(nn.Module):
    """A class's row of a table whose last row is no class, or a caption's pooled vector through an MLP, a learned
    null in place of no caption."""

    def __init__(self, dim, num_classes, pooled_width):
        super().__init__()
        if pooled_width:
            self.pooled = nn.Sequential(nn.Linear(pooled_width, dim), nn.SiLU(), nn.Linear(dim, dim))
            self.null_pooled = nn.Parameter(torch.zeros(pooled_width))
        else:
            self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, labels, pooled, batch):
        if hasattr(self, "pooled"):
            return self.pooled(self.null_pooled.expand(batch, -1) if pooled is None else pooled.to(self.null_pooled))
        return self.embedding_table(labels)


class _Embed(nn.Module):
    def __init__(self, dim, num_classes, pooled_width, frequency_size):
        super().__init__()
        self.frequency_size = frequency_size
        self.time = nn.Module()
        self.time.mlp = nn.Sequential(nn.Linear(frequency_size, dim), nn.SiLU(), nn.Linear(dim, dim))
        if num_classes or pooled_width:
            self.label = _Label(dim, num_classes, pooled_width)

    def forward(self, t, labels, pooled):
        emb = self.time.mlp(timestep_embedding(t, self.frequency_size))
        return emb + self.label(labels, pooled, len(t)) if hasattr(self, "label") else emb


class DDMRouter(ModelMixin, ConfigMixin):
    """p(cluster | x_t, t, condition) as logits: DiT blocks over patches of x_t, mean-pooled, a linear head, anchored
    at the prior: log p(k | class) + (1 - t) f(x_t, t, class), exact at t = 1 where x_t is noise. A caption reads
    through its pooled vector and the clusters' sizes (the table's last row)."""

    @register_to_config
    def __init__(self, sample_size: int, in_channels: int, num_experts: int, patch_size: int = 4,
                 hidden_size: int = 128, depth: int = 4, num_heads: int = 4, num_classes: int = 0,
                 pooled_width: int = 0, frequency_size: int = 256):
        super().__init__()
        self.x_embedder = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)
        self.embed = _Embed(hidden_size, num_classes, pooled_width, frequency_size)
        self.register_buffer("pos_embed", sincos_2d(sample_size // patch_size, hidden_size).unsqueeze(0))
        self.blocks = nn.ModuleList(_Block(hidden_size, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, num_experts)
        self.anchor = nn.Module()
        self.anchor.register_buffer("log_prior", torch.zeros(num_classes + 1, num_experts))

    def forward(self, x, t, class_labels=None, pooled=None):
        """Logits (B, K); `class_labels` None (or the index num_classes): no class; `pooled` None: no caption."""
        none = self.config.num_classes  # a router that reads no class routes every sample by the sizes' row
        labels = class_labels if class_labels is not None and none else torch.full((len(x),), none, device=x.device)
        h = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        c = self.embed(t, labels, pooled)
        for block in self.blocks:
            h = block(h, c)
        logits = self.head(self.norm(h.mean(1)))
        return self.anchor.log_prior[labels].to(logits.dtype) + (1 - t).to(logits.dtype)[:, None] * logits


class ConditionRouter(nn.Module):
    """p(cluster | caption) from its pooled vector, which ancestral routing draws a prompt's expert from."""

    def __init__(self, width, clusters, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, clusters))

    def forward(self, pooled):
        return self.net(pooled.float()).softmax(1).double()


# --- the experts ---------------------------------------------------------------------------------------------------

class Caption:
    """A batch of captions as the text encoder gave them: token states (B, L, width), their mask (B, L) and the
    pooled vector (B, pooled_width)."""

    def __init__(self, states, mask, pooled):
        self.states, self.mask, self.pooled = states, mask.bool(), pooled

    def __getitem__(self, rows):
        return Caption(self.states[rows], self.mask[rows], self.pooled[rows])


class Expert:
    """One expert's velocity, called as its class's own pipelines call it: the timestep scale (0-999 for the U-Nets
    and DiT, sigma x 1000 for SD3, [0, 1] for Flux, which scales it itself), its conditioning, Flux's 2x2 packing,
    DiT's learned sigma sliced off."""

    def __init__(self, model, num_classes: int, null: dict | None):
        self.model, self.name = model, type(model).__name__
        self.num_classes, self.null = num_classes, null  # null: islands_null_caption.safetensors, a text expert's

    def no_class(self, batch, device):
        none = self.model.config.num_embeds_ada_norm if self.name == "DiTTransformer2DModel" else self.num_classes
        return torch.full((batch,), none, dtype=torch.long, device=device)

    def __call__(self, x, t, labels=None, caption=None):
        m = self.model
        if self.name in OWN_CLASSES:  # diffusers' arguments; no class or caption is the network's own null
            given = {} if caption is None else {"encoder_hidden_states": caption.states.to(x.dtype),
                                                "encoder_attention_mask": caption.mask,
                                                "pooled_projections": caption.pooled.to(x.dtype)}
            return m(x, 1000 * t, class_labels=labels, **given).sample
        if self.name in ("UNet2DModel", "DiTTransformer2DModel"):
            if labels is None and (self.num_classes or self.name == "DiTTransformer2DModel"):
                labels = self.no_class(len(x), x.device)
            return m(x, 1000 * t, class_labels=labels).sample[:, :x.shape[1]]
        if caption is None:  # its learned null: text_tokens rows, the null token first (the U-Net reads it alone)
            null = self.null
            caption = Caption(null["encoder_hidden_states"].to(x).expand(len(x), -1, -1),
                              null.get("encoder_attention_mask", torch.ones(1, 1)).to(x.device).expand(len(x), -1),
                              null.get("pooled_projections", torch.zeros(1, 1)).to(x).expand(len(x), -1))
        if self.name == "UNet2DConditionModel":
            return m(x, 1000 * t, encoder_hidden_states=caption.states.to(x.dtype),
                     encoder_attention_mask=caption.mask).sample
        if self.name == "SD3Transformer2DModel":
            return m(x, encoder_hidden_states=caption.states.to(x.dtype), pooled_projections=caption.pooled.to(x.dtype),
                     timestep=1000 * t).sample
        b, c, h, w = x.shape  # Flux: FluxPipeline's _pack_latents and _prepare_latent_image_ids
        packed = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)
        img_ids = torch.zeros(h // 2, w // 2, 3, device=x.device)
        img_ids[..., 1] += torch.arange(h // 2, device=x.device)[:, None]
        img_ids[..., 2] += torch.arange(w // 2, device=x.device)[None, :]
        out = m(packed, encoder_hidden_states=caption.states.to(x.dtype), pooled_projections=caption.pooled.to(x.dtype),
                timestep=t, img_ids=img_ids.reshape(-1, 3),
                txt_ids=torch.zeros(caption.states.shape[1], 3, device=x.device)).sample
        return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


# --- routing ------------------------------------------------------------------------------------------------------

def parse_routing(spec: str) -> dict:
    """{"policy", "top_k", "p", "switch"} of a policy of ROUTINGS; ValueError names the spec otherwise."""
    name, _, arg = spec.partition(":")
    late, at, switch = arg.rpartition("@")
    try:
        if name in ("ancestral", "full", "sample") and not arg:
            return {"policy": name, "top_k": 1}
        if name == "top1" and not arg:
            return {"policy": "topk", "top_k": 1}
        if name == "topk" and int(arg) >= 1:
            return {"policy": "topk", "top_k": int(arg)}
        if name == "nucleus" and 0 < float(arg) <= 1:
            return {"policy": "nucleus", "p": float(arg)}
        if name == "ancestral_then" and at and late.startswith("topk:") and 0 < float(switch) < 1:
            return {"policy": "ancestral_then", "top_k": int(late[5:]), "switch": float(switch)}
    except ValueError:
        pass
    raise ValueError(f"routing: {spec!r} is not one of {', '.join(ROUTINGS)}")


def routed_weights(probs: torch.Tensor, routing: dict, generator: torch.Generator) -> torch.Tensor:
    """(B, K) float64 weights of the experts a policy selects from the router's probabilities, rows summing to 1."""
    policy = routing["policy"]
    if policy == "full" or (policy == "nucleus" and routing["p"] >= 1):
        return probs
    if policy == "sample":
        drawn = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1)
        return F.one_hot(drawn.to(probs.device), probs.shape[1]).double()
    if policy == "nucleus":  # the smallest set whose probabilities reach p
        ordered, indices = probs.sort(dim=1, descending=True)
        selected = ordered.cumsum(1) - ordered < routing["p"]
    else:  # the top k
        indices = probs.topk(routing["top_k"], dim=1).indices
        selected = True
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, indices, selected)
    chosen = probs * keep
    return chosen / chosen.sum(1, keepdim=True)


class DDMPipeline:
    """The experts, the router, the scheduler and the partition's priors of an exported ensemble."""

    def __init__(self, experts, router, scheduler, index, condition_router=None):
        self.experts, self.router, self.scheduler, self.index = experts, router, scheduler, index
        self.condition_router = condition_router

    @classmethod
    def from_folder(cls, folder, device="cpu") -> "DDMPipeline":
        root = Path(folder)
        index = json.loads((root / INDEX).read_text())
        files = index["files"]
        experts, own = [], None
        for entry in index["experts"]:
            config = json.loads(read_verified(root, f"{entry['folder']}/config.json",
                                              files[f"{entry['folder']}/config.json"]))
            name = config.get("_class_name")
            if name not in EXPERT_CLASSES + OWN_CLASSES:
                raise ValueError(f"{root / entry['folder']}: {name!r} is not one of "
                                 f"{', '.join(EXPERT_CLASSES + OWN_CLASSES)}")
            if name in OWN_CLASSES and own is None:
                own = own_networks(root, files)
            model_class = getattr(own, name) if name in OWN_CLASSES else getattr(diffusers, name)
            model = load_component(root, files, entry["folder"], model_class)
            null, null_file = None, f"{entry['folder']}/{NULL_CAPTION}"
            if null_file in files:
                null = {k: v.to(device) for k, v in
                        safetensors_load(read_verified(root, null_file, files[null_file])).items()}
            experts.append(Expert(model.to(device), index["num_classes"], null))
        router = load_component(root, files, "router", DDMRouter).to(device) if "router" in index else None
        scheduler_config = "scheduler/scheduler_config.json"
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(
            json.loads(read_verified(root, scheduler_config, files[scheduler_config])))
        condition_router = None
        if "condition_router" in index:
            spec = index["condition_router"]
            condition_router = ConditionRouter(spec["width"], spec["clusters"], spec["hidden"])
            condition_router.load_state_dict(safetensors_load(read_verified(root, spec["weights"],
                                                                            files[spec["weights"]])))
            condition_router = condition_router.to(device).eval()
        return cls(experts, router, scheduler, index, condition_router)

    def ancestral_clusters(self, num, class_labels, caption, generator):
        """Each sample's expert drawn once, from p(cluster | its class), p(cluster | its caption) or the sizes."""
        prior = torch.tensor(self.index["prior"], dtype=torch.float64).expand(num, -1)
        if class_labels is not None and self.index.get("prior_by_class"):
            prior = torch.tensor(self.index["prior_by_class"], dtype=torch.float64)[class_labels.cpu()]
        elif caption is not None and self.condition_router is not None:
            with torch.no_grad():
                prior = self.condition_router(caption.pooled).cpu()
        return torch.multinomial(prior, 1, generator=generator).squeeze(1)

    def weights(self, x, t, routing, class_labels, caption, clusters, generator) -> torch.Tensor:
        """Each sample's weight on each expert (B, K), float64."""
        num = len(self.experts)
        if routing["policy"] in ("ancestral", "ancestral_then"):
            ancestral = F.one_hot(clusters.to(x.device), num).double()
            late = t <= routing.get("switch", 0.0)
            if routing["policy"] == "ancestral" or not late.any():
                return ancestral
            ancestral[late] = self.weights(x[late], t[late], {**routing, "policy": "topk"},
                                           None if class_labels is None else class_labels[late],
                                           None if caption is None else caption[late], None, generator)
            return ancestral
        if self.router is None:
            raise ValueError(f"routing {routing['policy']!r} asks the router, and this ensemble ships none")
        dtype = next(self.router.parameters()).dtype
        logits = self.router(x.to(dtype), t.to(dtype), class_labels, None if caption is None else caption.pooled)
        probs = logits.float().softmax(-1).to(x.dtype).double()
        return routed_weights(probs, routing, generator)

    def velocity(self, x, t, routing, guidance, class_labels, caption, clusters, generator) -> torch.Tensor:
        """sum_k w_k [u_k + guidance (u_k(c) - u_k)] over the selected experts, each run on its own samples."""
        weights = self.weights(x, t, routing, class_labels, caption, clusters, generator)
        conditioned = class_labels is not None or caption is not None
        out = torch.zeros_like(x)
        for k, expert in enumerate(self.experts):
            rows = (weights[:, k] > 0).nonzero().squeeze(1)
            if not len(rows):
                continue
            labels = None if class_labels is None else class_labels[rows]
            text = None if caption is None else caption[rows]
            v = expert(x[rows], t[rows], labels, text)
            if conditioned and guidance != 1.0:
                v_none = expert(x[rows], t[rows])
                v = v_none + guidance * (v - v_none)
            out[rows] += weights[rows, k].to(x.dtype).view(-1, *[1] * (x.dim() - 1)) * v.to(x.dtype)
        return out

    @torch.no_grad()
    def __call__(self, num_images: int = 1, class_labels=None, caption: Caption | None = None, routing=None,
                 num_inference_steps: int | None = None, guidance_scale: float | None = None, latents=None,
                 clusters=None, generator: torch.Generator | None = None, routing_seed: int = 0) -> torch.Tensor:
        """`num_images` samples in the data's space ([-1, 1] pixels, or the latents the experts learnt), (B, C, H, W).
        `latents`: the starting noise (drawn from `generator` if None); `clusters`: each sample's expert under
        ancestral routing (drawn from the priors if None); `routing_seed` keys the draws of the `sample` policy."""
        defaults = self.index["sample"]
        routing = parse_routing(routing or defaults["routing"])
        steps = num_inference_steps or defaults["steps"]
        guidance = defaults["guidance"] if guidance_scale is None else guidance_scale
        device = self.experts[0].model.device
        if latents is None:
            latents = torch.randn(num_images, *self.index["shape"], generator=generator).to(device)
        x = latents.to(device=device, dtype=torch.float32)
        if class_labels is not None:
            class_labels = torch.as_tensor(class_labels, dtype=torch.long, device=device)
        if caption is not None:  # on the experts' device, as every tensor that meets them
            caption = Caption(caption.states.to(device), caption.mask.to(device), caption.pooled.to(device))
        if routing["policy"] in ("ancestral", "ancestral_then") and clusters is None:
            clusters = self.ancestral_clusters(len(x), class_labels, caption, generator)
        draws = torch.Generator().manual_seed(routing_seed)
        # Islands' Euler grid, linspace(1, 0, steps + 1); the scheduler shifts it as the experts' training was
        self.scheduler.set_timesteps(sigmas=torch.linspace(1, 0, steps + 1)[:-1].tolist(), device=device)
        for i, timestep in enumerate(self.scheduler.timesteps):
            t = self.scheduler.sigmas[i].to(x).expand(len(x))
            v = self.velocity(x, t, routing, guidance, class_labels, caption, clusters, draws)
            x = self.scheduler.step(v, timestep, x).prev_sample
        return x

/**
 * The architecture registry: each entry maps one HF config family onto the single internal
 * shape (ModelShape + ArchExtras) and says where its weights live. A new architecture is one
 * entry here (plus at most one new graph block); nothing else branches on the architecture.
 */
import type { ModelShape, MoeShape } from './contract.ts'
import { CheckpointError, UnsupportedArchitectureError } from './errors.ts'
import { rotaryOf, type RopeSpec, type Rotary } from './rope.ts'
import type { F32Tensor, WeightStore } from './safetensors.ts'

/** What differs between the supported families, as data the graph blocks read. */
export interface ArchExtras {
  /** q/k/v projections carry a bias (Qwen2). */
  qkvBias: boolean
  /** RMSNorm over head_dim on q and k before RoPE (Qwen3). */
  qkNorm: boolean
  rope: RopeSpec
}

/** The normalised model: shape, extras, and the rotary tables baked into every stage. */
export interface ModelSpec {
  shape: ModelShape
  extras: ArchExtras
  rotary: Rotary
  mapping: ArchMapping
}

/** One SwiGLU MLP in HF layout: gate and up fused (rows: gate (I), up (I)), down [D, I]. */
export interface SwiGluWeights {
  gateUp: F32Tensor
  down: F32Tensor
}

/** A mixture-of-experts block's weights: router [E, D], E routed experts, optionally a gated shared expert. */
export interface MoeWeights {
  router: F32Tensor
  experts: SwiGluWeights[]
  /** Qwen2-MoE: an expert every row runs, scaled by sigmoid(gate · x); gate is [1, D]. */
  shared?: SwiGluWeights & { gate: F32Tensor }
}

/**
 * One decoder layer's weights in HF layout ([out, in]); q, k, v and gate, up already fused. A
 * dense layer has gateUp and down; a mixture-of-experts layer has moe instead.
 */
export interface LayerWeights {
  inputNorm: F32Tensor
  postNorm: F32Tensor
  /** Rows: q (H·hd), k (kvH·hd), v (kvH·hd). */
  qkv: F32Tensor
  qkvBias?: F32Tensor
  qNorm?: F32Tensor
  kNorm?: F32Tensor
  o: F32Tensor
  /** Rows: gate (I), up (I). */
  gateUp?: F32Tensor
  down?: F32Tensor
  moe?: MoeWeights
}

export interface ArchMapping {
  /** HF `architectures[0]` values and `model_type` values this entry handles. */
  architectures: string[]
  modelTypes: string[]
  normalize: (config: HfConfig) => { shape: ModelShape, extras: ArchExtras }
  embedName: string
  finalNormName: string
  lmHeadName: string
  layer: (w: WeightStore, l: number) => Promise<LayerWeights>
}

export type HfConfig = Record<string, unknown>

function num (c: HfConfig, key: string, fallback?: number): number {
  const v = c[key]
  if (typeof v === 'number') return v
  if (fallback !== undefined) return fallback
  throw new CheckpointError(`config.json: missing numeric "${key}"`)
}

/** Fields every Llama-like family shares. */
function baseShape (c: HfConfig, architecture: string): ModelShape {
  const hiddenSize = num(c, 'hidden_size')
  const numHeads = num(c, 'num_attention_heads')
  const sliding = typeof c.sliding_window === 'number' && c.use_sliding_window !== false ? c.sliding_window : undefined
  const maxPositions = num(c, 'max_position_embeddings', 4096)
  return {
    architecture,
    hiddenSize,
    numLayers: num(c, 'num_hidden_layers'),
    numHeads,
    numKvHeads: num(c, 'num_key_value_heads', numHeads),
    headDim: typeof c.head_dim === 'number' ? c.head_dim : hiddenSize / numHeads,
    intermediateSize: num(c, 'intermediate_size'),
    vocabSize: num(c, 'vocab_size'),
    // Without a sliding-window op, the window bounds the context we can serve exactly.
    maxPositions: sliding !== undefined && sliding < maxPositions ? sliding : maxPositions,
    rmsNormEps: num(c, 'rms_norm_eps', 1e-6),
    tieWordEmbeddings: c.tie_word_embeddings === true,
  }
}

function ropeOf (c: HfConfig): RopeSpec {
  // transformers >= 5 nests everything under rope_parameters.
  const params = (c.rope_parameters ?? c.rope_scaling ?? null) as Record<string, unknown> | null
  const theta = typeof params?.rope_theta === 'number' ? params.rope_theta : num(c, 'rope_theta', 10000)
  const type = (params?.rope_type ?? params?.type ?? 'default') as string
  if (typeof c.partial_rotary_factor === 'number' && c.partial_rotary_factor !== 1) {
    throw new CheckpointError(`config.json: partial_rotary_factor ${c.partial_rotary_factor} is not supported`)
  }
  const original = c.original_max_position_embeddings
  return {
    theta,
    type,
    params: params ?? {},
    maxPositionEmbeddings: num(c, 'max_position_embeddings', 4096),
    ...(typeof original === 'number' ? { originalMaxPositionEmbeddings: original } : {}),
  }
}

function checkNoExtraBias (c: HfConfig, what: string): void {
  if (c.mlp_bias === true) throw new CheckpointError(`${what}: mlp_bias=true is not supported`)
}

async function cat (w: WeightStore, names: string[]): Promise<F32Tensor> {
  const parts = await Promise.all(names.map(n => w.get(n)))
  const cols = parts[0]!.shape.slice(1)
  const rows = parts.reduce((s, p) => s + p.shape[0]!, 0)
  const data = new Float32Array(parts.reduce((s, p) => s + p.data.length, 0))
  let off = 0
  for (const p of parts) { data.set(p.data, off); off += p.data.length }
  return { shape: [rows, ...cols], data }
}

const llamaLike = (opts: { architectures: string[], modelTypes: string[], name: string, qkvBias: (c: HfConfig) => boolean, qkNorm: boolean }): ArchMapping => ({
  architectures: opts.architectures,
  modelTypes: opts.modelTypes,
  normalize: (c) => {
    checkNoExtraBias(c, opts.name)
    return {
      shape: baseShape(c, opts.name),
      extras: { qkvBias: opts.qkvBias(c), qkNorm: opts.qkNorm, rope: ropeOf(c) },
    }
  },
  embedName: 'model.embed_tokens.weight',
  finalNormName: 'model.norm.weight',
  lmHeadName: 'lm_head.weight',
  layer: async (w, l) => {
    const p = `model.layers.${l}`
    const a = `${p}.self_attn`
    const bias = w.has(`${a}.q_proj.bias`)
    return {
      inputNorm: await w.get(`${p}.input_layernorm.weight`),
      postNorm: await w.get(`${p}.post_attention_layernorm.weight`),
      qkv: await cat(w, [`${a}.q_proj.weight`, `${a}.k_proj.weight`, `${a}.v_proj.weight`]),
      ...(bias ? { qkvBias: await cat(w, [`${a}.q_proj.bias`, `${a}.k_proj.bias`, `${a}.v_proj.bias`]) } : {}),
      ...(opts.qkNorm ? { qNorm: await w.get(`${a}.q_norm.weight`), kNorm: await w.get(`${a}.k_norm.weight`) } : {}),
      o: await w.get(`${a}.o_proj.weight`),
      gateUp: await cat(w, [`${p}.mlp.gate_proj.weight`, `${p}.mlp.up_proj.weight`]),
      down: await w.get(`${p}.mlp.down_proj.weight`),
    }
  },
})

async function swiGlu (w: WeightStore, gate: string, up: string, down: string): Promise<SwiGluWeights> {
  return { gateUp: await cat(w, [gate, up]), down: await w.get(down) }
}

/**
 * Which layers are MoE (HF's rule for Qwen-MoE: not in mlp_only_layers and (l + 1) divisible by
 * decoder_sparse_step; Mixtral: every layer) and how the router weighs the chosen experts.
 */
function moeShapeOf (c: HfConfig, family: 'mixtral' | 'qwen2_moe' | 'qwen3_moe', numLayers: number): MoeShape {
  const numExperts = family === 'mixtral' ? num(c, 'num_local_experts') : num(c, 'num_experts')
  const topK = num(c, 'num_experts_per_tok')
  if (topK < 1 || topK > numExperts) throw new CheckpointError(`config.json: num_experts_per_tok ${topK} with ${numExperts} experts`)
  const step = family === 'mixtral' ? 1 : num(c, 'decoder_sparse_step', 1)
  const only = family !== 'mixtral' && Array.isArray(c.mlp_only_layers) ? c.mlp_only_layers as number[] : []
  const moeLayers = Array.from({ length: numLayers }, (_, l) => l).filter(l => !only.includes(l) && (l + 1) % step === 0)
  return {
    numExperts,
    topK,
    expertIntermediateSize: family === 'mixtral' ? num(c, 'intermediate_size') : num(c, 'moe_intermediate_size'),
    // Mixtral's softmax over the chosen logits is the renormalised top-k of the full softmax.
    normTopK: family === 'mixtral' ? true : c.norm_topk_prob === true,
    sharedExpertIntermediateSize: family === 'qwen2_moe' ? num(c, 'shared_expert_intermediate_size', 0) : 0,
    moeLayers,
  }
}

const moeFamily = (opts: { family: 'mixtral' | 'qwen2_moe' | 'qwen3_moe', architectures: string[], qkvBias: boolean, qkNorm: boolean }): ArchMapping => {
  const dense = llamaLike({ name: opts.family, architectures: opts.architectures, modelTypes: [opts.family], qkvBias: () => opts.qkvBias, qkNorm: opts.qkNorm })
  return {
    ...dense,
    normalize: (c) => {
      if (c.attention_bias === true && !opts.qkvBias) throw new CheckpointError(`${opts.family}: attention_bias=true is not supported`)
      const { shape, extras } = dense.normalize(c)
      return { shape: { ...shape, moe: moeShapeOf(c, opts.family, shape.numLayers) }, extras }
    },
    // Whether a layer is MoE is read from the weights present: the config rule above decided
    // which ones the checkpoint has, and the compiler checks the two agree.
    layer: async (w, l) => {
      const p = `model.layers.${l}`
      const block = opts.family === 'mixtral' ? `${p}.block_sparse_moe` : `${p}.mlp`
      if (!w.has(`${block}.gate.weight`)) return await dense.layer(w, l)
      const a = `${p}.self_attn`
      const experts: SwiGluWeights[] = []
      for (let e = 0; w.has(`${block}.experts.${e}.${opts.family === 'mixtral' ? 'w1' : 'gate_proj'}.weight`); e++) {
        const x = `${block}.experts.${e}`
        experts.push(opts.family === 'mixtral'
          ? await swiGlu(w, `${x}.w1.weight`, `${x}.w3.weight`, `${x}.w2.weight`)
          : await swiGlu(w, `${x}.gate_proj.weight`, `${x}.up_proj.weight`, `${x}.down_proj.weight`))
      }
      const shared = w.has(`${block}.shared_expert.gate_proj.weight`)
        ? {
            ...await swiGlu(w, `${block}.shared_expert.gate_proj.weight`, `${block}.shared_expert.up_proj.weight`, `${block}.shared_expert.down_proj.weight`),
            gate: await w.get(`${block}.shared_expert_gate.weight`),
          }
        : undefined
      return {
        inputNorm: await w.get(`${p}.input_layernorm.weight`),
        postNorm: await w.get(`${p}.post_attention_layernorm.weight`),
        qkv: await cat(w, [`${a}.q_proj.weight`, `${a}.k_proj.weight`, `${a}.v_proj.weight`]),
        ...(opts.qkvBias ? { qkvBias: await cat(w, [`${a}.q_proj.bias`, `${a}.k_proj.bias`, `${a}.v_proj.bias`]) } : {}),
        ...(opts.qkNorm ? { qNorm: await w.get(`${a}.q_norm.weight`), kNorm: await w.get(`${a}.k_norm.weight`) } : {}),
        o: await w.get(`${a}.o_proj.weight`),
        moe: { router: await w.get(`${block}.gate.weight`), experts, ...(shared !== undefined ? { shared } : {}) },
      }
    },
  }
}

/** The registry. Order matters only for listing in error messages. */
export const ARCHITECTURES: ArchMapping[] = [
  llamaLike({
    name: 'llama',
    architectures: ['LlamaForCausalLM', 'MistralForCausalLM'],
    modelTypes: ['llama', 'mistral'],
    qkvBias: (c) => {
      if (c.attention_bias === true) throw new CheckpointError('llama: attention_bias=true is not supported')
      return false
    },
    qkNorm: false,
  }),
  llamaLike({ name: 'qwen2', architectures: ['Qwen2ForCausalLM'], modelTypes: ['qwen2'], qkvBias: () => true, qkNorm: false }),
  llamaLike({
    name: 'qwen3',
    architectures: ['Qwen3ForCausalLM'],
    modelTypes: ['qwen3'],
    qkvBias: (c) => c.attention_bias === true,
    qkNorm: true,
  }),
  moeFamily({ family: 'mixtral', architectures: ['MixtralForCausalLM'], qkvBias: false, qkNorm: false }),
  moeFamily({ family: 'qwen2_moe', architectures: ['Qwen2MoeForCausalLM'], qkvBias: true, qkNorm: false }),
  moeFamily({ family: 'qwen3_moe', architectures: ['Qwen3MoeForCausalLM'], qkvBias: false, qkNorm: true }),
  {
    architectures: ['Phi3ForCausalLM'],
    modelTypes: ['phi3'],
    normalize: (c) => {
      const rope = ropeOf(c)
      return { shape: baseShape(c, 'phi3'), extras: { qkvBias: false, qkNorm: false, rope } }
    },
    embedName: 'model.embed_tokens.weight',
    finalNormName: 'model.norm.weight',
    lmHeadName: 'lm_head.weight',
    layer: async (w, l) => {
      const p = `model.layers.${l}`
      return {
        inputNorm: await w.get(`${p}.input_layernorm.weight`),
        postNorm: await w.get(`${p}.post_attention_layernorm.weight`),
        qkv: await w.get(`${p}.self_attn.qkv_proj.weight`),
        o: await w.get(`${p}.self_attn.o_proj.weight`),
        gateUp: await w.get(`${p}.mlp.gate_up_proj.weight`),
        down: await w.get(`${p}.mlp.down_proj.weight`),
      }
    },
  },
]

export function supportedArchitectures (): string[] {
  return ARCHITECTURES.flatMap(a => a.architectures)
}

/** Finds the mapping for a config and normalises it; unknown families get a typed error naming the supported ones. */
export function normalizeConfig (config: HfConfig): ModelSpec {
  const archName = Array.isArray(config.architectures) && typeof config.architectures[0] === 'string' ? config.architectures[0] : undefined
  const modelType = typeof config.model_type === 'string' ? config.model_type : undefined
  const mapping = ARCHITECTURES.find(a => archName !== undefined ? a.architectures.includes(archName) : modelType !== undefined && a.modelTypes.includes(modelType))
  if (mapping === undefined) throw new UnsupportedArchitectureError(archName ?? modelType ?? '(none)', supportedArchitectures())
  const { shape, extras } = mapping.normalize(config)
  if (shape.hiddenSize <= 0 || shape.numLayers <= 0 || shape.numHeads % shape.numKvHeads !== 0) {
    throw new CheckpointError(`config.json: inconsistent shape (heads ${shape.numHeads}, kv heads ${shape.numKvHeads})`)
  }
  return { shape, extras, rotary: rotaryOf(shape.headDim, extras.rope), mapping }
}

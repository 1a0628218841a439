/**
 * Random-weight checkpoints in real Hugging Face layout (config.json, safetensors, tokenizer.json,
 * tokenizer_config.json with a chat template, generation_config.json) for every supported
 * architecture. Deterministic from a seed. The weights are random: the text they produce is
 * noise, but every code path (import, compile, split, decode) runs on them exactly as on a real model.
 *
 * One variant is not noise: `successor` makes a model whose greedy next token is a fixed cyclic
 * permutation π of the current token (see successorCycle), so its continuation of any token t is
 * t, π(t), π(π(t)), … — text a prompt can contain, which is what prompt lookup needs to be measured
 * (random weights never repeat their prompt). Construction: every layer's o_proj and down_proj
 * scaled by ε (the residual stream stays ≈ the current token's embedding E[t]; the layers still
 * run, attend and cost what they always do), and an untied lm_head whose row π(t) is E[t], so the
 * logit of π(t) is ≈ |E[t]|²/rms ≈ 3·√hidden while every other row is a nearly orthogonal random
 * vector (logit std ≈ 3). Special tokens and padding rows of lm_head are zero: never the argmax.
 */
import { mkdir, writeFile } from 'node:fs/promises'
import { join } from 'node:path'
import { writeSafetensors, type SafetensorsDtype, type TensorToWrite } from '../safetensors.ts'
import { hash32, Prng } from './prng.ts'
import { buildTokenizerJson } from './tokenizer.ts'

export type TestArchitecture = 'llama' | 'qwen2' | 'qwen3' | 'phi3' | MoeTestArchitecture
export type MoeTestArchitecture = 'mixtral' | 'qwen2-moe' | 'qwen3-moe'
export type TestModelSize = 'tiny' | 'small' | '60m' | '250m' | 'demo'

export interface GenerateOptions {
  architecture: TestArchitecture
  outDir: string
  size?: TestModelSize
  seed?: number
  tieWordEmbeddings?: boolean
  /** Stored weight dtype (default F32). */
  dtype?: SafetensorsDtype
  /** Write the weights as N safetensors files with model.safetensors.index.json (default 1 file). */
  weightShards?: number
  /** HF rope_scaling block, e.g. { rope_type: 'llama3', factor: 8, ... } or { rope_type: 'linear', factor: 2 }. */
  ropeScaling?: Record<string, unknown>
  /**
   * A long-context rope block as the papers' families write it: 'longrope' (Phi-3.5: short and
   * long factor lists, original_max_position_embeddings at the config's top level) or 'yarn'
   * (Qwen2.5 long-context / DeepSeek: factor, original_max_position_embeddings, beta_fast/slow
   * in the block), extending originalMaxPositions to the size's max_position_embeddings. Wins
   * over ropeScaling.
   */
  longContext?: { rope: 'longrope' | 'yarn', originalMaxPositions: number }
  /** Written into config.json as shoal_description and carried into the manifest. */
  description?: string
  /** Written into config.json as shoal_model_id: the id the compiled manifest serves under. */
  modelId?: string
  /** Overrides the size's layer count (e.g. 24 tiny layers to split like a real 24-layer model). */
  layers?: number
  /** Merged over the generated config.json (e.g. num_experts_per_tok for router tests). */
  configOverrides?: Record<string, unknown>
  /** Rewrites a generated tensor in place before it is written (e.g. a router with tied rows). */
  tensorHook?: (name: string, data: Float32Array, shape: number[]) => void
  /** Vocabulary instead of the size's (0: the tokenizer's 512, no padded rows). */
  vocab?: number
  /**
   * Scales o_proj and down_proj of layers ≥ fromLayer by `scale`: those layers then add only
   * ε-sized updates to the residual stream, so the model's logits track those of the same seed's
   * first `fromLayer` layers (see generateDraftPair).
   */
  residualScale?: { fromLayer: number, scale: number }
  /**
   * A successor model (see the module comment): greedy decoding follows the cycle
   * successorCycle(architecture, seed). `epsilon` scales every layer's output projections (default
   * 0.01; 0 makes the layers exact no-ops). Implies an untied head; wins over residualScale.
   */
  successor?: { epsilon?: number }
}

interface SizeSpec { hidden: number, layers: number, heads: number, kvHeads: number, ffn: number, vocab: number, maxPositions: number }

const SIZES: Record<TestModelSize, SizeSpec> = {
  tiny: { hidden: 64, layers: 4, heads: 4, kvHeads: 2, ffn: 128, vocab: 512, maxPositions: 2048 },
  small: { hidden: 256, layers: 6, heads: 8, kvHeads: 2, ffn: 704, vocab: 1024, maxPositions: 4096 },
  '60m': { hidden: 512, layers: 8, heads: 8, kvHeads: 2, ffn: 1536, vocab: 32000, maxPositions: 4096 },
  '250m': { hidden: 1024, layers: 16, heads: 16, kvHeads: 4, ffn: 2816, vocab: 32000, maxPositions: 4096 },
  // The 60m shape with the vocabulary cut to the tokenizer's: padded ids would decode to nothing,
  // and a demo whose every other token prints nothing looks broken.
  demo: { hidden: 512, layers: 8, heads: 8, kvHeads: 2, ffn: 1536, vocab: 0, maxPositions: 4096 },
}

/** The tokenizer's size (bytes + merges + specials); the model vocab is padded up to SizeSpec.vocab. */
const TOKENIZER_SIZE = 512

interface ArchProfile {
  hfArchitecture: string
  modelType: string
  specials: string[]
  bos?: string
  eos: string
  /** Extra eos ids for generation_config (token texts). */
  genEos: string[]
  pad?: string
  addBosToken: boolean
  chatTemplate: string
  tiedByDefault: boolean
  extraConfig: (s: SizeSpec) => Record<string, unknown>
  /** Weight names and shapes of layer l, in HF layout. */
  layer: (p: string, s: SizeSpec, hd: number, l: number) => Array<[string, number[], 'linear' | 'norm' | 'bias']>
}

const LLAMA_TEMPLATE = "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] + '\\n\\n' %}{%- set loop_messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- set loop_messages = messages %}{%- endif %}{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}{%- if loop.first %}{{- '[INST] ' + system + message['content'] + ' [/INST]' }}{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- else %}{{- raise_exception('Only system, user and assistant roles are supported') }}{%- endif %}{%- endfor %}"
const CHATML_TEMPLATE = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
const PHI3_TEMPLATE = "{%- for message in messages %}{%- if message['role'] in ['system', 'user', 'assistant'] %}{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}{%- else %}{{- raise_exception('Unknown role: ' + message['role']) }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- else %}{{- eos_token }}{%- endif %}"

const llamaLayer = (bias: boolean, qkNorm: boolean) => (p: string, s: SizeSpec, hd: number): Array<[string, number[], 'linear' | 'norm' | 'bias']> => {
  const a = `${p}.self_attn`
  const out: Array<[string, number[], 'linear' | 'norm' | 'bias']> = [
    [`${p}.input_layernorm.weight`, [s.hidden], 'norm'],
    [`${a}.q_proj.weight`, [s.heads * hd, s.hidden], 'linear'],
    [`${a}.k_proj.weight`, [s.kvHeads * hd, s.hidden], 'linear'],
    [`${a}.v_proj.weight`, [s.kvHeads * hd, s.hidden], 'linear'],
  ]
  if (bias) out.push([`${a}.q_proj.bias`, [s.heads * hd], 'bias'], [`${a}.k_proj.bias`, [s.kvHeads * hd], 'bias'], [`${a}.v_proj.bias`, [s.kvHeads * hd], 'bias'])
  if (qkNorm) out.push([`${a}.q_norm.weight`, [hd], 'norm'], [`${a}.k_norm.weight`, [hd], 'norm'])
  out.push(
    [`${a}.o_proj.weight`, [s.hidden, s.heads * hd], 'linear'],
    [`${p}.post_attention_layernorm.weight`, [s.hidden], 'norm'],
    [`${p}.mlp.gate_proj.weight`, [s.ffn, s.hidden], 'linear'],
    [`${p}.mlp.up_proj.weight`, [s.ffn, s.hidden], 'linear'],
    [`${p}.mlp.down_proj.weight`, [s.hidden, s.ffn], 'linear'],
  )
  return out
}

/**
 * The test MoE shape: 8 experts, top 2, experts a quarter of the dense width (Qwen-MoE's
 * moe_intermediate_size; Mixtral's experts are intermediate_size wide, as in HF).
 */
const MOE_EXPERTS = 8
const MOE_TOP_K = 2
const moeWidth = (s: SizeSpec): number => s.ffn / 4
/** Qwen3-MoE keeps layer 0 dense (mlp_only_layers), so dense and MoE layers meet in one model and one stage. */
const QWEN3_MOE_DENSE_LAYERS = [0]

type LayerTensors = Array<[string, number[], 'linear' | 'norm' | 'bias']>
const swiGluTensors = (p: string, D: number, I: number, names = ['gate_proj', 'up_proj', 'down_proj']): LayerTensors => [
  [`${p}.${names[0]}.weight`, [I, D], 'linear'],
  [`${p}.${names[1]}.weight`, [I, D], 'linear'],
  [`${p}.${names[2]}.weight`, [D, I], 'linear'],
]

/** A llama-like layer whose MLP is replaced by a MoE block (attention tensors first, as HF orders them). */
const moeLayer = (family: MoeTestArchitecture) => (p: string, s: SizeSpec, hd: number, l: number): LayerTensors => {
  const dense = llamaLayer(family === 'qwen2-moe', family === 'qwen3-moe')(p, s, hd)
  if (family === 'qwen3-moe' && QWEN3_MOE_DENSE_LAYERS.includes(l)) return dense
  const attn = dense.filter(([name]) => !name.includes('.mlp.'))
  if (family === 'mixtral') {
    const b = `${p}.block_sparse_moe`
    return [...attn, [`${b}.gate.weight`, [MOE_EXPERTS, s.hidden], 'linear'],
      ...Array.from({ length: MOE_EXPERTS }, (_, e) => swiGluTensors(`${b}.experts.${e}`, s.hidden, s.ffn, ['w1', 'w3', 'w2'])).flat()]
  }
  const b = `${p}.mlp`
  const out: LayerTensors = [...attn, [`${b}.gate.weight`, [MOE_EXPERTS, s.hidden], 'linear'],
    ...Array.from({ length: MOE_EXPERTS }, (_, e) => swiGluTensors(`${b}.experts.${e}`, s.hidden, moeWidth(s))).flat()]
  if (family === 'qwen2-moe') out.push(...swiGluTensors(`${b}.shared_expert`, s.hidden, s.ffn / 2), [`${b}.shared_expert_gate.weight`, [1, s.hidden], 'linear'])
  return out
}

/** The Llama families' special tokens, chat template and untied head (Llama and Mixtral alike). */
const LLAMA_TOKENS = {
  specials: ['<unk>', '<s>', '</s>'],
  bos: '<s>',
  eos: '</s>',
  genEos: ['</s>'],
  addBosToken: true,
  chatTemplate: LLAMA_TEMPLATE,
  tiedByDefault: false,
} satisfies Partial<ArchProfile>

/** The Qwen families' special tokens, chat template and tied head (Qwen2 and Qwen3 alike). */
const QWEN_TOKENS = {
  specials: ['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
  eos: '<|im_end|>',
  genEos: ['<|im_end|>', '<|endoftext|>'],
  pad: '<|endoftext|>',
  addBosToken: false,
  chatTemplate: CHATML_TEMPLATE,
  tiedByDefault: true,
} satisfies Partial<ArchProfile>

const PROFILES: Record<TestArchitecture, ArchProfile> = {
  llama: {
    hfArchitecture: 'LlamaForCausalLM',
    modelType: 'llama',
    ...LLAMA_TOKENS,
    extraConfig: () => ({ attention_bias: false, mlp_bias: false, hidden_act: 'silu', pretraining_tp: 1 }),
    layer: llamaLayer(false, false),
  },
  qwen2: {
    hfArchitecture: 'Qwen2ForCausalLM',
    modelType: 'qwen2',
    ...QWEN_TOKENS,
    extraConfig: (s) => ({ hidden_act: 'silu', use_sliding_window: false, sliding_window: s.maxPositions, max_window_layers: 0 }),
    layer: llamaLayer(true, false),
  },
  qwen3: {
    hfArchitecture: 'Qwen3ForCausalLM',
    modelType: 'qwen3',
    ...QWEN_TOKENS,
    extraConfig: (s) => ({ hidden_act: 'silu', attention_bias: false, use_sliding_window: false, sliding_window: null, head_dim: s.hidden / s.heads }),
    layer: llamaLayer(false, true),
  },
  mixtral: {
    hfArchitecture: 'MixtralForCausalLM',
    modelType: 'mixtral',
    ...LLAMA_TOKENS,
    extraConfig: () => ({
      hidden_act: 'silu', sliding_window: null, num_local_experts: MOE_EXPERTS, num_experts_per_tok: MOE_TOP_K,
      output_router_logits: false, router_aux_loss_coef: 0.02, router_jitter_noise: 0,
    }),
    layer: moeLayer('mixtral'),
  },
  'qwen2-moe': {
    hfArchitecture: 'Qwen2MoeForCausalLM',
    modelType: 'qwen2_moe',
    ...QWEN_TOKENS,
    extraConfig: (s) => ({
      hidden_act: 'silu', use_sliding_window: false, sliding_window: s.maxPositions, max_window_layers: 0,
      num_experts: MOE_EXPERTS, num_experts_per_tok: MOE_TOP_K, moe_intermediate_size: moeWidth(s), shared_expert_intermediate_size: s.ffn / 2,
      decoder_sparse_step: 1, mlp_only_layers: [], norm_topk_prob: false, output_router_logits: false, router_aux_loss_coef: 0.001,
    }),
    layer: moeLayer('qwen2-moe'),
  },
  'qwen3-moe': {
    hfArchitecture: 'Qwen3MoeForCausalLM',
    modelType: 'qwen3_moe',
    ...QWEN_TOKENS,
    extraConfig: (s) => ({
      hidden_act: 'silu', attention_bias: false, use_sliding_window: false, sliding_window: null, head_dim: s.hidden / s.heads,
      num_experts: MOE_EXPERTS, num_experts_per_tok: MOE_TOP_K, moe_intermediate_size: moeWidth(s),
      decoder_sparse_step: 1, mlp_only_layers: QWEN3_MOE_DENSE_LAYERS, norm_topk_prob: true, output_router_logits: false, router_aux_loss_coef: 0.001,
    }),
    layer: moeLayer('qwen3-moe'),
  },
  phi3: {
    hfArchitecture: 'Phi3ForCausalLM',
    modelType: 'phi3',
    specials: ['<unk>', '<s>', '</s>', '<|endoftext|>', '<|system|>', '<|user|>', '<|assistant|>', '<|end|>'],
    bos: '<s>',
    eos: '<|endoftext|>',
    genEos: ['<|endoftext|>', '<|end|>', '<|assistant|>'],
    pad: '<|endoftext|>',
    addBosToken: false,
    chatTemplate: PHI3_TEMPLATE,
    tiedByDefault: false,
    extraConfig: () => ({ hidden_act: 'silu', sliding_window: null, original_max_position_embeddings: 4096, partial_rotary_factor: 1.0 }),
    layer: (p, s, hd) => [
      [`${p}.input_layernorm.weight`, [s.hidden], 'norm'],
      [`${p}.self_attn.qkv_proj.weight`, [(s.heads + 2 * s.kvHeads) * hd, s.hidden], 'linear'],
      [`${p}.self_attn.o_proj.weight`, [s.hidden, s.heads * hd], 'linear'],
      [`${p}.post_attention_layernorm.weight`, [s.hidden], 'norm'],
      [`${p}.mlp.gate_up_proj.weight`, [2 * s.ffn, s.hidden], 'linear'],
      [`${p}.mlp.down_proj.weight`, [s.hidden, s.ffn], 'linear'],
    ],
  },
}

/** The dense architectures (what the dense-path test suites iterate). */
export const TEST_ARCHITECTURES: TestArchitecture[] = ['llama', 'qwen2', 'qwen3', 'phi3']
/** The mixture-of-experts architectures. */
export const MOE_TEST_ARCHITECTURES: MoeTestArchitecture[] = ['mixtral', 'qwen2-moe', 'qwen3-moe']

/**
 * The rope block (and Phi-3's top-level original_max_position_embeddings) for a long-context
 * test model. LongRoPE's factors are shaped like Phi-3.5's: short ones near 1, long ones growing
 * from 1 towards the low frequencies (here up to the extension factor).
 */
function longContextConfig (o: { rope: 'longrope' | 'yarn', originalMaxPositions: number }, hd: number, maxPositions: number): Record<string, unknown> {
  const factor = maxPositions / o.originalMaxPositions
  if (!(factor > 1)) throw new Error(`longContext: originalMaxPositions ${o.originalMaxPositions} must be below max_position_embeddings ${maxPositions}`)
  const half = hd / 2
  if (o.rope === 'yarn') {
    return { rope_scaling: { rope_type: 'yarn', factor, original_max_position_embeddings: o.originalMaxPositions, beta_fast: 32, beta_slow: 1 } }
  }
  const t = (i: number): number => half === 1 ? 1 : i / (half - 1)
  return {
    original_max_position_embeddings: o.originalMaxPositions,
    rope_scaling: {
      type: 'longrope',
      short_factor: Array.from({ length: half }, (_, i) => 1 + 0.25 * t(i) ** 2),
      long_factor: Array.from({ length: half }, (_, i) => factor ** (t(i) ** 2)),
    },
  }
}

/** Target std of logits: peaked enough that greedy ties are rare, flat enough that text does not loop at once. */
const LOGIT_STD = 3
/** o_proj and down_proj are scaled up so the residual updates outweigh the (tied) embedding: otherwise greedy text echoes its last token. */
const RESIDUAL_GAIN = 2

export async function generateTestModel (options: GenerateOptions): Promise<void> {
  const prof = PROFILES[options.architecture]
  const size = {
    ...SIZES[options.size ?? 'tiny'],
    ...(options.layers === undefined ? {} : { layers: options.layers }),
    ...(options.vocab === undefined ? {} : { vocab: options.vocab }),
  }
  const seed = options.seed ?? 1
  const successor = options.successor
  const tied = successor !== undefined ? false : options.tieWordEmbeddings ?? prof.tiedByDefault
  const hd = size.hidden / size.heads
  const tok = buildTokenizerJson(TOKENIZER_SIZE, prof.specials, prof.addBosToken ? prof.bos : undefined)
  const vocab = Math.max(size.vocab, tok.size)
  const id = (t: string | undefined): number | undefined => t === undefined ? undefined : tok.specialIds.get(t)
  await mkdir(options.outDir, { recursive: true })

  const config: Record<string, unknown> = {
    architectures: [prof.hfArchitecture],
    model_type: prof.modelType,
    hidden_size: size.hidden,
    intermediate_size: size.ffn,
    num_hidden_layers: size.layers,
    num_attention_heads: size.heads,
    num_key_value_heads: size.kvHeads,
    vocab_size: vocab,
    max_position_embeddings: size.maxPositions,
    rms_norm_eps: 1e-6,
    rope_theta: 10000,
    rope_scaling: options.ropeScaling ?? null,
    tie_word_embeddings: tied,
    bos_token_id: id(prof.bos) ?? null,
    eos_token_id: id(prof.eos),
    initializer_range: 0.02,
    use_cache: true,
    torch_dtype: { F32: 'float32', F16: 'float16', BF16: 'bfloat16' }[options.dtype ?? 'F32'],
    transformers_version: '4.46.0',
    ...prof.extraConfig(size),
    ...(options.longContext !== undefined ? longContextConfig(options.longContext, hd, size.maxPositions) : {}),
    ...(options.modelId !== undefined ? { shoal_model_id: options.modelId } : {}),
    shoal_description: options.description ?? (successor !== undefined
      ? `successor weights (shoal test model: ${options.architecture} ${options.size ?? 'tiny'}, seed ${seed}; greedy text follows a fixed token cycle); not a trained model`
      : `random weights (shoal test model: ${options.architecture} ${options.size ?? 'tiny'}, seed ${seed}); not a trained model`),
    ...options.configOverrides,
  }

  const damping = (name: string): number => {
    const r = successor !== undefined ? { fromLayer: 0, scale: successor.epsilon ?? 0.01 } : options.residualScale
    const layer = /^model\.layers\.(\d+)\./.exec(name)?.[1]
    return r !== undefined && layer !== undefined && Number(layer) >= r.fromLayer ? r.scale : 1
  }
  // Per-tensor streams: a tensor's values depend only on (seed, name), not on what else is written.
  const special = new Set(tok.specialIds.values())
  const headScale = LOGIT_STD / Math.sqrt(size.hidden)
  const cycle = successor !== undefined ? cycleOf(tok.size, tok.specialIds, seed) : undefined
  const gen = (name: string, shape: number[], kind: 'linear' | 'norm' | 'bias' | 'embed'): TensorToWrite => ({
    name,
    shape,
    data: () => {
      const rng = new Prng(hash32(name) ^ Math.imul(seed, 0x9e3779b1))
      const n = shape.reduce((a, b) => a * b, 1)
      const out = new Float32Array(n)
      if (cycle !== undefined && name === 'lm_head.weight') {
        // Row π(t) = E[t] along the cycle; every other row (specials, padding) stays zero.
        const embed = (gen('model.embed_tokens.weight', shape, 'embed').data as () => Float32Array)()
        const d = shape[1]!
        for (let i = 0; i < cycle.length; i++) {
          const t = cycle[i]!
          const next = cycle[(i + 1) % cycle.length]!
          out.set(embed.subarray(t * d, (t + 1) * d), next * d)
        }
      } else if (kind === 'norm') for (let i = 0; i < n; i++) out[i] = 1 + 0.1 * rng.normal()
      else if (kind === 'bias') for (let i = 0; i < n; i++) out[i] = 0.1 * rng.normal()
      else if (kind === 'linear') { const s = (/(o_proj|down_proj|\.w2\.)/.test(name) ? RESIDUAL_GAIN * damping(name) : 1) / Math.sqrt(shape[1]!); for (let i = 0; i < n; i++) out[i] = s * rng.normal() }
      else {
        // Rows past the tokenizer stay zero (padding, never the argmax); special tokens are damped so random text rarely hits EOS.
        const d = shape[1]!
        for (let r = 0; r < Math.min(shape[0]!, tok.size); r++) {
          const s = special.has(r) ? headScale * 0.3 : headScale
          for (let c = 0; c < d; c++) out[r * d + c] = s * rng.normal()
        }
      }
      options.tensorHook?.(name, out, shape)
      return out
    },
  })
  const tensors: TensorToWrite[] = [gen('model.embed_tokens.weight', [vocab, size.hidden], 'embed')]
  for (let l = 0; l < size.layers; l++) {
    for (const [name, shape, kind] of prof.layer(`model.layers.${l}`, size, hd, l)) tensors.push(gen(name, shape, kind))
  }
  tensors.push(gen('model.norm.weight', [size.hidden], 'norm'))
  if (!tied) tensors.push(gen('lm_head.weight', [vocab, size.hidden], 'embed'))

  const dtype = options.dtype ?? 'F32'
  const shards = Math.max(1, Math.min(options.weightShards ?? 1, tensors.length))
  if (shards === 1) {
    await writeSafetensors(join(options.outDir, 'model.safetensors'), tensors, dtype)
  } else {
    const weightMap: Record<string, string> = {}
    const per = Math.ceil(tensors.length / shards)
    let total = 0
    for (let i = 0; i < shards; i++) {
      const part = tensors.slice(i * per, (i + 1) * per)
      const file = `model-${String(i + 1).padStart(5, '0')}-of-${String(shards).padStart(5, '0')}.safetensors`
      for (const t of part) { weightMap[t.name] = file; total += t.shape.reduce((a, b) => a * b, 1) * (dtype === 'F32' ? 4 : 2) }
      await writeSafetensors(join(options.outDir, file), part, dtype)
    }
    await writeJson(join(options.outDir, 'model.safetensors.index.json'), { metadata: { total_size: total }, weight_map: weightMap })
  }

  const eosIds = prof.genEos.map(t => id(t)!)
  await writeJson(join(options.outDir, 'config.json'), config)
  await writeJson(join(options.outDir, 'generation_config.json'), {
    ...(prof.bos !== undefined ? { bos_token_id: id(prof.bos) } : {}),
    eos_token_id: eosIds.length === 1 ? eosIds[0] : eosIds,
    ...(prof.pad !== undefined ? { pad_token_id: id(prof.pad) } : {}),
    _from_model_config: false,
    transformers_version: '4.46.0',
  })
  await writeJson(join(options.outDir, 'tokenizer.json'), tok.tokenizerJson)
  const added = Object.fromEntries([...tok.specialIds].map(([content, i]) => [String(i), {
    content, lstrip: false, normalized: false, rstrip: false, single_word: false, special: true,
  }]))
  await writeJson(join(options.outDir, 'tokenizer_config.json'), {
    add_bos_token: prof.addBosToken,
    add_eos_token: false,
    added_tokens_decoder: added,
    bos_token: prof.bos ?? null,
    eos_token: prof.eos,
    pad_token: prof.pad ?? null,
    unk_token: prof.specials.includes('<unk>') ? '<unk>' : null,
    chat_template: prof.chatTemplate,
    clean_up_tokenization_spaces: false,
    model_max_length: size.maxPositions,
    tokenizer_class: ['llama', 'phi3', 'mixtral'].includes(prof.modelType) ? 'LlamaTokenizerFast' : 'Qwen2TokenizerFast',
  })
  await writeJson(join(options.outDir, 'special_tokens_map.json'), {
    ...(prof.bos !== undefined ? { bos_token: prof.bos } : {}),
    eos_token: prof.eos,
    ...(prof.pad !== undefined ? { pad_token: prof.pad } : {}),
  })
}

export interface DraftPairOptions {
  architecture: TestArchitecture
  /** Writes `draft/` and `target/` checkpoints under it. */
  outDir: string
  size?: TestModelSize
  seed?: number
  /** Layers of the draft; the target has these same layers first (default 1). */
  draftLayers?: number
  /** Layers the target adds after them (default 3). */
  extraLayers?: number
  /**
   * Scale of the extra layers' output projections: 0 makes the target compute exactly the draft's
   * function (agreement 100 %), small values keep the target's logits close to the draft's (high
   * agreement), 1 makes them ordinary layers (the two models disagree about as often as unrelated
   * random models). Default 0.05.
   */
  epsilon?: number
  /** Vocabulary instead of the size's (0: the tokenizer's 512). */
  vocab?: number
  /** Model ids the compiled manifests serve under (default 'draft' / 'target'). */
  draftId?: string
  targetId?: string
}

/**
 * A draft/target pair with tunable agreement, for speculative decoding: the same seed gives both
 * the same embedding, head, final norm and first layers (a tensor's values depend only on seed and
 * name), and the target adds layers whose residual updates are scaled by ε. Random weights make
 * two independent models disagree on nearly every token; this pair agrees as often as ε allows.
 */
export async function generateDraftPair (options: DraftPairOptions): Promise<{ draftDir: string, targetDir: string }> {
  const draftLayers = options.draftLayers ?? 1
  const extra = options.extraLayers ?? 3
  const common = {
    architecture: options.architecture,
    ...(options.size === undefined ? {} : { size: options.size }),
    ...(options.vocab === undefined ? {} : { vocab: options.vocab }),
    seed: options.seed ?? 1,
  }
  const draftDir = join(options.outDir, 'draft')
  const targetDir = join(options.outDir, 'target')
  await generateTestModel({ ...common, outDir: draftDir, layers: draftLayers, modelId: options.draftId ?? 'draft', description: `random weights (shoal draft model: ${draftLayers} layers); not a trained model` })
  await generateTestModel({
    ...common,
    outDir: targetDir,
    layers: draftLayers + extra,
    residualScale: { fromLayer: draftLayers, scale: options.epsilon ?? 0.05 },
    modelId: options.targetId ?? 'target',
    description: `random weights (shoal target model: draft + ${extra} layers at ε = ${options.epsilon ?? 0.05}); not a trained model`,
  })
  return { draftDir, targetDir }
}

/**
 * The cycle a successor model (GenerateOptions.successor) follows: every non-special token of the
 * tokenizer once, in a seeded random order; π(cycle[i]) = cycle[(i + 1) mod length]. One cycle
 * (not any permutation, whose cycles may be short) so that an orbit runs ~500 tokens before it repeats.
 */
export function successorCycle (architecture: TestArchitecture, seed = 1): number[] {
  const prof = PROFILES[architecture]
  const tok = buildTokenizerJson(TOKENIZER_SIZE, prof.specials, prof.addBosToken ? prof.bos : undefined)
  return cycleOf(tok.size, tok.specialIds, seed)
}

export interface CopyTaskOptions {
  /** successorCycle(...) of the model. */
  cycle: readonly number[]
  /** Tokens of the text the prompt carries (and the model's continuation repeats); default 200. */
  length?: number
  /** Index in that text replaced by another token (the prompt's text then differs from the continuation at one place); omit for none. */
  change?: number
  /** Tokens of unrelated text before it (default 24). */
  prefix?: number
  /** Where in the cycle the text starts (default 0). */
  start?: number
}

/**
 * A prompt for a successor model shaped like "rewrite this text with one change": unrelated
 * tokens, then a stretch of the cycle (the text, one token of it changed), a separator, and the
 * text's first token again. The model's greedy continuation is the rest of the stretch (the
 * original, unchanged) and beyond, so prompt lookup finds nearly all of it earlier in the prompt —
 * but only by matching the text so far, not by position. Every token is a non-special one; the
 * prefix, separator and changed token are taken from the cycle outside the stretch (read
 * backwards, so they do not continue it).
 */
export function copyTaskPrompt (o: CopyTaskOptions): { ids: number[], continuation: (count: number) => number[] } {
  const n = o.cycle.length
  const length = o.length ?? 200
  const prefix = o.prefix ?? 24
  const start = o.start ?? 0
  if (length + prefix + 4 > n) throw new Error(`copyTaskPrompt: ${length} + ${prefix} + 4 tokens do not fit a cycle of ${n}`)
  const at = (i: number): number => o.cycle[((start + i) % n + n) % n]!
  const text = Array.from({ length }, (_, i) => at(i))
  const outside = Array.from({ length: prefix + 3 }, (_, i) => at(-1 - i))
  if (o.change !== undefined) text[o.change] = outside[prefix + 2]!
  const ids = [...outside.slice(0, prefix), ...text, outside[prefix]!, outside[prefix + 1]!, at(0)]
  return { ids, continuation: count => Array.from({ length: count }, (_, i) => at(1 + i)) }
}

function cycleOf (size: number, specialIds: Map<string, number>, seed: number): number[] {
  const special = new Set(specialIds.values())
  const ids = Array.from({ length: size }, (_, i) => i).filter(i => !special.has(i))
  const rng = new Prng(hash32('successor-cycle') ^ Math.imul(seed, 0x9e3779b1))
  for (let i = ids.length - 1; i > 0; i--) {
    const j = rng.u32() % (i + 1)
    const x = ids[i]!; ids[i] = ids[j]!; ids[j] = x
  }
  return ids
}

async function writeJson (file: string, value: unknown): Promise<void> {
  await writeFile(file, JSON.stringify(value, null, 2) + '\n')
}

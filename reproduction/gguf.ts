/**
 * A minimal GGUF v3 writer for the llama.cpp comparison (bench-vs-llamacpp.ts): a generated Llama
 * checkpoint (safetensors + the byte-level BPE tokenizer.json of shards/testmodel) written as one
 * GGUF file, every tensor F32, or every 2-D weight Q4_0 (the output matrix and the embedding too)
 * with norms kept F32 — so llama.cpp runs the very tensors shoal compiles. Benchmark code only:
 * nothing in the daemon reads or writes GGUF.
 *
 * Format (ggml's docs/gguf.md): magic "GGUF", version 3, tensor count and KV count (u64), the KV
 * pairs, the tensor infos (name, dims fastest-first, ggml type, offset into the data section), then
 * the data section aligned to `general.alignment` (32), each tensor's start aligned too.
 */
import { open } from 'node:fs/promises'
import { readFile } from 'node:fs/promises'
import { join } from 'node:path'
import { openWeights } from '../shards/safetensors.ts'

// ---------------------------------------------------------------------------------------------
// Q4_0: ggml's reference quantizer (quantize_row_q4_0_ref), from its definition.

/** Values per Q4_0 block, and bytes per block: an f16 scale and 32 4-bit codes. */
export const Q4_0_BLOCK = 32
export const Q4_0_BLOCK_BYTES = 2 + Q4_0_BLOCK / 2

const f32 = Math.fround
const F32_BUF = new Float32Array(1)
const U32_VIEW = new Uint32Array(F32_BUF.buffer)

/** IEEE half from a float32, round to nearest even (what F16C's vcvtps2ph and ggml's scalar path do). */
export function f32ToF16 (x: number): number {
  F32_BUF[0] = x
  const bits = U32_VIEW[0]!
  const sign = (bits >>> 16) & 0x8000
  const exp = (bits >>> 23) & 0xff
  let mant = bits & 0x7fffff
  if (exp === 0xff) return sign | 0x7c00 | (mant !== 0 ? 0x200 : 0) // Inf / NaN
  const e = exp - 127 + 15
  if (e >= 0x1f) return sign | 0x7c00 // overflow → Inf
  if (e <= 0) {
    // Subnormal half (or zero): shift the implicit-1 mantissa right, round to nearest even.
    if (e < -10) return sign
    mant |= 0x800000
    const shift = 14 - e
    const half = 1 << (shift - 1)
    const rest = mant & ((1 << shift) - 1)
    let h = mant >>> shift
    if (rest > half || (rest === half && (h & 1) === 1)) h++
    return sign | h
  }
  const rest = mant & 0x1fff
  let h = (e << 10) | (mant >>> 13)
  if (rest > 0x1000 || (rest === 0x1000 && (h & 1) === 1)) h++ // a carry into the exponent is correct rounding
  return sign | h
}

/**
 * One row of Q4_0 blocks. Per block of 32: the value of largest magnitude `max` (its sign kept; the
 * first one wins ties), d = max / -8, codes q = min(15, trunc(x · (1/d) + 8.5)) — all in float32 —
 * the first 16 values in the low nibbles of bytes 0..15, the last 16 in the high nibbles; d is
 * stored as f16. Dequantized: (q − 8) · d.
 */
export function quantizeQ4_0 (x: Float32Array, out: Uint8Array, outOffset = 0): void {
  if (x.length % Q4_0_BLOCK !== 0) throw new Error(`Q4_0 needs a multiple of ${Q4_0_BLOCK} values, got ${x.length}`)
  const view = new DataView(out.buffer, out.byteOffset, out.byteLength)
  for (let b = 0; b < x.length / Q4_0_BLOCK; b++) {
    const base = b * Q4_0_BLOCK
    let amax = 0
    let max = 0
    for (let j = 0; j < Q4_0_BLOCK; j++) {
      const v = x[base + j]!
      if (amax < Math.abs(v)) { amax = Math.abs(v); max = v }
    }
    const d = f32(max / -8)
    const id = d !== 0 ? f32(1 / d) : 0
    const o = outOffset + b * Q4_0_BLOCK_BYTES
    view.setUint16(o, f32ToF16(d), true)
    for (let j = 0; j < Q4_0_BLOCK / 2; j++) {
      const x0 = f32(f32(x[base + j]! * id) + 8.5)
      const x1 = f32(f32(x[base + Q4_0_BLOCK / 2 + j]! * id) + 8.5)
      // C's (int8_t) cast truncates toward zero; x·id lies in [-8, 8], so x0, x1 are ≥ 0.5.
      const q0 = Math.min(15, Math.trunc(x0))
      const q1 = Math.min(15, Math.trunc(x1))
      out[o + 2 + j] = q0 | (q1 << 4)
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GGUF encoding.

const GGUF_MAGIC = 0x46554747 // "GGUF" little-endian
const GGUF_VERSION = 3
export const GGUF_ALIGNMENT = 32

/** GGUF value types (the ones written here). */
const ValueType = { U32: 4, I32: 5, F32: 6, BOOL: 7, STRING: 8, ARRAY: 9 } as const
/** ggml tensor types used here. */
export const GgmlType = { F32: 0, Q4_0: 2 } as const
export type GgmlType = typeof GgmlType[keyof typeof GgmlType]

export type KvValue =
  | { type: 'u32', value: number }
  | { type: 'i32', value: number }
  | { type: 'f32', value: number }
  | { type: 'bool', value: boolean }
  | { type: 'string', value: string }
  | { type: 'string[]', value: string[] }
  | { type: 'i32[]', value: number[] }
  | { type: 'f32[]', value: number[] }

export interface GgufTensor {
  name: string
  /** Dimensions fastest-varying first (ggml's ne): an HF [out, in] matrix is [in, out]. */
  dims: number[]
  type: GgmlType
  /** Produces the tensor's bytes (exactly tensorBytes(dims, type)) when it is written. */
  data: () => Promise<Uint8Array>
}

export function tensorBytes (dims: number[], type: GgmlType): number {
  const n = dims.reduce((a, b) => a * b, 1)
  return type === GgmlType.F32 ? n * 4 : (n / Q4_0_BLOCK) * Q4_0_BLOCK_BYTES
}

const align = (n: number): number => Math.ceil(n / GGUF_ALIGNMENT) * GGUF_ALIGNMENT

class ByteWriter {
  private chunks: Buffer[] = []
  length = 0
  private push (b: Buffer): void { this.chunks.push(b); this.length += b.length }
  u32 (v: number): void { const b = Buffer.alloc(4); b.writeUInt32LE(v); this.push(b) }
  i32 (v: number): void { const b = Buffer.alloc(4); b.writeInt32LE(v); this.push(b) }
  u64 (v: number): void { const b = Buffer.alloc(8); b.writeBigUInt64LE(BigInt(v)); this.push(b) }
  f32 (v: number): void { const b = Buffer.alloc(4); b.writeFloatLE(v); this.push(b) }
  u8 (v: number): void { this.push(Buffer.from([v])) }
  str (s: string): void { const b = Buffer.from(s, 'utf8'); this.u64(b.length); this.push(b) }
  pad (to: number): void { const n = align(to) - to; if (n > 0) this.push(Buffer.alloc(n)) }
  bytes (): Buffer { return Buffer.concat(this.chunks) }
}

function writeKv (w: ByteWriter, key: string, v: KvValue): void {
  w.str(key)
  switch (v.type) {
    case 'u32': w.u32(ValueType.U32); w.u32(v.value); break
    case 'i32': w.u32(ValueType.I32); w.i32(v.value); break
    case 'f32': w.u32(ValueType.F32); w.f32(v.value); break
    case 'bool': w.u32(ValueType.BOOL); w.u8(v.value ? 1 : 0); break
    case 'string': w.u32(ValueType.STRING); w.str(v.value); break
    case 'string[]': w.u32(ValueType.ARRAY); w.u32(ValueType.STRING); w.u64(v.value.length); for (const s of v.value) w.str(s); break
    case 'i32[]': w.u32(ValueType.ARRAY); w.u32(ValueType.I32); w.u64(v.value.length); for (const x of v.value) w.i32(x); break
    case 'f32[]': w.u32(ValueType.ARRAY); w.u32(ValueType.F32); w.u64(v.value.length); for (const x of v.value) w.f32(x); break
  }
}

/** The header (magic through tensor infos, padded): the data section starts right after it. */
export function ggufHeader (kv: Array<[string, KvValue]>, tensors: Array<Omit<GgufTensor, 'data'>>): Buffer {
  const w = new ByteWriter()
  w.u32(GGUF_MAGIC)
  w.u32(GGUF_VERSION)
  w.u64(tensors.length)
  w.u64(kv.length)
  for (const [k, v] of kv) writeKv(w, k, v)
  let offset = 0
  for (const t of tensors) {
    w.str(t.name)
    w.u32(t.dims.length)
    for (const d of t.dims) w.u64(d)
    w.u32(t.type)
    w.u64(offset)
    offset = align(offset + tensorBytes(t.dims, t.type))
  }
  w.pad(w.length)
  return w.bytes()
}

/** Writes a GGUF file, one tensor in memory at a time; returns the bytes of tensor data written. */
export async function writeGguf (file: string, kv: Array<[string, KvValue]>, tensors: GgufTensor[]): Promise<number> {
  const fh = await open(file, 'w')
  try {
    const header = ggufHeader(kv, tensors)
    await fh.write(header)
    let pos = 0
    let dataBytes = 0
    for (const t of tensors) {
      const bytes = await t.data()
      const want = tensorBytes(t.dims, t.type)
      if (bytes.length !== want) throw new Error(`${t.name}: ${bytes.length} bytes, expected ${want}`)
      await fh.write(bytes)
      dataBytes += bytes.length
      pos += bytes.length
      const padded = align(pos)
      if (padded > pos) { await fh.write(Buffer.alloc(padded - pos)); pos = padded }
    }
    return dataBytes
  } finally {
    await fh.close()
  }
}

// ---------------------------------------------------------------------------------------------
// HF Llama checkpoint → llama.cpp's llama GGUF.

/**
 * convert_hf_to_gguf.py's permutation of q_proj / k_proj rows: HF rotates the two halves of each
 * head (rotate_half), llama.cpp's llama graph rotates adjacent pairs, so within each head row
 * p·(hd/2) + j moves to row 2j + p.
 */
export function permuteForRope (w: Float32Array, rows: number, cols: number, heads: number): Float32Array {
  const hd = rows / heads
  const half = hd / 2
  const out = new Float32Array(w.length)
  for (let h = 0; h < heads; h++) {
    for (let p = 0; p < 2; p++) {
      for (let j = 0; j < half; j++) {
        const src = (h * hd + p * half + j) * cols
        const dst = (h * hd + 2 * j + p) * cols
        out.set(w.subarray(src, src + cols), dst)
      }
    }
  }
  return out
}

export type GgufWeights = 'f32' | 'q4_0'

interface HfConfig {
  hidden_size: number
  intermediate_size: number
  num_hidden_layers: number
  num_attention_heads: number
  num_key_value_heads: number
  vocab_size: number
  max_position_embeddings: number
  rms_norm_eps: number
  rope_theta: number
  tie_word_embeddings: boolean
  bos_token_id: number | null
  eos_token_id: number
  model_type: string
  rope_scaling: unknown
}

interface TokenizerJson {
  added_tokens: Array<{ id: number, content: string, special: boolean }>
  model: { type: string, vocab: Record<string, number>, merges: string[] }
}

/** GGUF token types (llama.cpp's llama_token_type). */
const TOKEN_NORMAL = 1
const TOKEN_CONTROL = 3
const TOKEN_UNUSED = 5

/**
 * Writes `file` from the checkpoint in `modelDir` (a shards/testmodel Llama: byte-level BPE
 * tokenizer, no rope scaling). Returns the tensor data bytes (the "weight bytes" of the file).
 */
export async function checkpointToGguf (modelDir: string, file: string, weights: GgufWeights): Promise<number> {
  const cfg = JSON.parse(await readFile(join(modelDir, 'config.json'), 'utf8')) as HfConfig
  if (cfg.model_type !== 'llama') throw new Error(`${modelDir}: only llama checkpoints (got ${cfg.model_type})`)
  if (cfg.rope_scaling !== null && cfg.rope_scaling !== undefined) throw new Error(`${modelDir}: rope_scaling is not written to GGUF here`)
  const tok = JSON.parse(await readFile(join(modelDir, 'tokenizer.json'), 'utf8')) as TokenizerJson
  if (tok.model.type !== 'BPE') throw new Error(`${modelDir}: tokenizer model ${tok.model.type}, expected BPE`)

  // The vocabulary: the tokenizer's tokens, then placeholders up to the model's padded vocab size
  // (their embedding and output rows are zero; llama.cpp needs one token text per row).
  const texts = new Array<string>(cfg.vocab_size)
  const types = new Array<number>(cfg.vocab_size).fill(TOKEN_UNUSED)
  for (const [t, id] of Object.entries(tok.model.vocab)) { texts[id] = t; types[id] = TOKEN_NORMAL }
  for (const a of tok.added_tokens) { texts[a.id] = a.content; types[a.id] = a.special ? TOKEN_CONTROL : TOKEN_NORMAL }
  for (let i = 0; i < texts.length; i++) texts[i] ??= `[PAD${i}]`
  const unk = tok.added_tokens.find(a => a.content === '<unk>')?.id

  const hd = cfg.hidden_size / cfg.num_attention_heads
  const kv: Array<[string, KvValue]> = [
    ['general.architecture', { type: 'string', value: 'llama' }],
    ['general.name', { type: 'string', value: `shoal test model (${modelDir.split('/').at(-1) ?? 'llama'})` }],
    ['general.file_type', { type: 'u32', value: weights === 'f32' ? 0 : 2 }], // LLAMA_FTYPE_ALL_F32 / MOSTLY_Q4_0
    ['general.alignment', { type: 'u32', value: GGUF_ALIGNMENT }],
    ['llama.context_length', { type: 'u32', value: cfg.max_position_embeddings }],
    ['llama.embedding_length', { type: 'u32', value: cfg.hidden_size }],
    ['llama.block_count', { type: 'u32', value: cfg.num_hidden_layers }],
    ['llama.feed_forward_length', { type: 'u32', value: cfg.intermediate_size }],
    ['llama.attention.head_count', { type: 'u32', value: cfg.num_attention_heads }],
    ['llama.attention.head_count_kv', { type: 'u32', value: cfg.num_key_value_heads }],
    ['llama.attention.layer_norm_rms_epsilon', { type: 'f32', value: cfg.rms_norm_eps }],
    ['llama.rope.freq_base', { type: 'f32', value: cfg.rope_theta }],
    ['llama.rope.dimension_count', { type: 'u32', value: hd }],
    ['llama.vocab_size', { type: 'u32', value: cfg.vocab_size }],
    ['tokenizer.ggml.model', { type: 'string', value: 'gpt2' }],
    ['tokenizer.ggml.pre', { type: 'string', value: 'default' }],
    ['tokenizer.ggml.tokens', { type: 'string[]', value: texts }],
    ['tokenizer.ggml.token_type', { type: 'i32[]', value: types }],
    ['tokenizer.ggml.merges', { type: 'string[]', value: tok.model.merges }],
    ...(cfg.bos_token_id !== null ? [['tokenizer.ggml.bos_token_id', { type: 'u32', value: cfg.bos_token_id }] as [string, KvValue]] : []),
    ['tokenizer.ggml.eos_token_id', { type: 'u32', value: cfg.eos_token_id }],
    ...(unk !== undefined ? [['tokenizer.ggml.unknown_token_id', { type: 'u32', value: unk }] as [string, KvValue]] : []),
    ['tokenizer.ggml.add_bos_token', { type: 'bool', value: cfg.bos_token_id !== null }],
  ]

  const store = await openWeights(modelDir)
  const tensors: GgufTensor[] = []
  const add = (ggufName: string, hfName: string, permuteHeads?: number): void => {
    const shape = store.shapeOf(hfName)
    const dims = [...shape].reverse()
    const matrix = shape.length === 2
    const type = matrix && weights === 'q4_0' ? GgmlType.Q4_0 : GgmlType.F32
    tensors.push({
      name: ggufName,
      dims,
      type,
      data: async () => {
        let data = (await store.get(hfName)).data
        if (permuteHeads !== undefined) data = permuteForRope(data, shape[0]!, shape[1]!, permuteHeads)
        if (type === GgmlType.F32) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength)
        const out = new Uint8Array(tensorBytes(dims, type))
        quantizeQ4_0(data, out)
        return out
      },
    })
  }
  add('token_embd.weight', 'model.embed_tokens.weight')
  for (let l = 0; l < cfg.num_hidden_layers; l++) {
    const p = `model.layers.${l}`
    add(`blk.${l}.attn_norm.weight`, `${p}.input_layernorm.weight`)
    add(`blk.${l}.attn_q.weight`, `${p}.self_attn.q_proj.weight`, cfg.num_attention_heads)
    add(`blk.${l}.attn_k.weight`, `${p}.self_attn.k_proj.weight`, cfg.num_key_value_heads)
    add(`blk.${l}.attn_v.weight`, `${p}.self_attn.v_proj.weight`)
    add(`blk.${l}.attn_output.weight`, `${p}.self_attn.o_proj.weight`)
    add(`blk.${l}.ffn_norm.weight`, `${p}.post_attention_layernorm.weight`)
    add(`blk.${l}.ffn_gate.weight`, `${p}.mlp.gate_proj.weight`)
    add(`blk.${l}.ffn_up.weight`, `${p}.mlp.up_proj.weight`)
    add(`blk.${l}.ffn_down.weight`, `${p}.mlp.down_proj.weight`)
  }
  add('output_norm.weight', 'model.norm.weight')
  // A tied head has no lm_head tensor: llama.cpp then reuses token_embd (as HF does).
  if (!cfg.tie_word_embeddings) add('output.weight', 'lm_head.weight')
  return await writeGguf(file, kv, tensors)
}

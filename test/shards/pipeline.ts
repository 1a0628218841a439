/**
 * Test helper: runs a compiled shard directory's stage graphs directly with onnxruntime-node,
 * chaining hidden_states_out → hidden_states, with an explicit KV cache per layer.
 */
import ort from 'onnxruntime-node'
import { nextPast } from '../kv-append.ts'
import { alignColumns } from '../../daemon/engine/kv-block.ts'
import { top2 } from '../support/reference.ts'
import { mkdtemp, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { Tokenizer } from '@huggingface/tokenizers'
import {
  ATTENTION_MASK, HIDDEN_IN, HIDDEN_OUT, INPUT_IDS, LOGITS, NUM_LOGITS_TO_KEEP, POSITION_IDS,
  generateTestModel, pastKeyName, pastValueName, TEST_ARCHITECTURES, type ShardManifest, type TestArchitecture,
} from '../../shards/index.ts'

export interface Pipeline {
  manifest: ShardManifest
  sessions: ort.InferenceSession[]
  release: () => Promise<void>
}

export async function openPipeline (dir: string, manifest: ShardManifest): Promise<Pipeline> {
  const sessions: ort.InferenceSession[] = []
  for (const s of manifest.stages) {
    sessions.push(await ort.InferenceSession.create(join(dir, s.graph), { intraOpNumThreads: 1, interOpNumThreads: 1 }))
  }
  return { manifest, sessions, release: async () => { for (const s of sessions) await s.release() } }
}

export const i64 = (v: number[], dims: number[]): ort.Tensor => new ort.Tensor('int64', BigInt64Array.from(v.map(BigInt)), dims)

/** The prompt's token ids with the model's own tokenizer (as written by generateTestModel). */
export async function encodePrompt (modelDir: string, text: string): Promise<number[]> {
  const json = async (f: string): Promise<object> => JSON.parse(await readFile(join(modelDir, f), 'utf8')) as object
  return new Tokenizer(await json('tokenizer.json'), await json('tokenizer_config.json')).encode(text).ids
}

/** Empty KV (P = 0) for every layer, batch B. */
export function emptyPast (m: ShardManifest, B: number): Map<string, ort.Tensor> {
  const { numKvHeads: kvH, headDim: hd } = m.shape
  const past = new Map<string, ort.Tensor>()
  for (let l = 0; l < m.shape.numLayers; l++) {
    past.set(pastKeyName(l), new ort.Tensor('float32', new Float32Array(0), [B, kvH, 0, hd]))
    past.set(pastValueName(l), new ort.Tensor('float32', new Float32Array(0), [B, kvH, 0, hd]))
  }
  return past
}

export interface StageStep {
  /** Token ids and positions, flattened [B, S]; attention mask flattened [B, T]. */
  ids: number[]
  pos: number[]
  mask: number[]
  B: number
  S: number
  T: number
  /** num_logits_to_keep (0 = all). */
  keep: number
}

/** One step through every stage: returns the head's logits tensor and every layer's present KV (keyed by past name). */
export async function runStages (p: Pipeline, x: StageStep, past: Map<string, ort.Tensor>): Promise<{ logits: ort.Tensor, present: Map<string, ort.Tensor> }> {
  let hidden: ort.Tensor | undefined
  let logits: ort.Tensor | undefined
  const present = new Map<string, ort.Tensor>()
  for (const [i, s] of p.manifest.stages.entries()) {
    const feeds: Record<string, ort.Tensor> = { [POSITION_IDS]: i64(x.pos, [x.B, x.S]), [ATTENTION_MASK]: i64(x.mask, [x.B, x.T]) }
    if (s.hasEmbedding) feeds[INPUT_IDS] = i64(x.ids, [x.B, x.S])
    else feeds[HIDDEN_IN] = hidden!
    if (s.hasHead) feeds[NUM_LOGITS_TO_KEEP] = i64([x.keep], [])
    for (let l = s.layers[0]; l <= s.layers[1]; l++) {
      feeds[pastKeyName(l)] = past.get(pastKeyName(l))!
      feeds[pastValueName(l)] = past.get(pastValueName(l))!
    }
    const out = await p.sessions[i]!.run(feeds)
    for (let l = s.layers[0]; l <= s.layers[1]; l++) {
      for (const [name, kind] of [[pastKeyName(l), 'key'], [pastValueName(l), 'value']] as const) {
        const lengths = Array.from({ length: x.B }, (_, b) => x.mask.slice(b * x.T, (b + 1) * x.T).reduce((n, m) => n + m, 0) - x.S)
        const next = nextPast(out, past.get(name) as { data: Float32Array, dims: readonly number[] } | undefined, l, kind, lengths)
        present.set(name, new ort.Tensor('float32', next.data, next.dims))
      }
    }
    if (s.hasHead) logits = out[LOGITS]
    else hidden = out[HIDDEN_OUT]
  }
  return { logits: logits!, present }
}

/** One step through every stage for B rows (nested arrays), keeping the last position's logits. */
export async function stepRows (p: Pipeline, ids: number[][], pos: number[][], mask: number[][], past: Map<string, ort.Tensor>): Promise<{ logits: Float32Array, present: Map<string, ort.Tensor> }> {
  const r = await runStages(p, { ids: ids.flat(), pos: pos.flat(), mask: mask.flat(), B: ids.length, S: ids[0]!.length, T: mask[0]!.length, keep: 1 }, past)
  return { logits: r.logits.data as Float32Array, present: r.present }
}

/** The prompt the shard tests encode with each test model's tokenizer. */
export const TEST_PROMPT = 'The quick brown fox jumps over the lazy dog. Once upon a time'

/** The largest absolute difference between two arrays' elements. */
export const maxDiff = (a: ArrayLike<number>, b: ArrayLike<number>): number => {
  let m = 0
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i]! - b[i]!))
  return m
}

/** A greedy decode's tokens and each step's logits. */
export interface GreedyRun { tokens: number[], logits: ArrayLike<number>[] }

/**
 * Where a greedy decode `got` parts from a reference decode `want` of the same prompt: `at`, the
 * first step whose tokens differ (the steps decoded when none); `diff`, the largest logit difference
 * over the steps both saw the same sequence (the split's included); `margin`, the reference's best
 * two logits' gap at the split (undefined without one). Two computations whose bits differ may part
 * only at a near tie: a margin no larger than about the difference.
 */
export function greedySplit (got: GreedyRun, want: GreedyRun): { at: number, diff: number, margin: number | undefined } {
  const n = got.tokens.length
  const first = got.tokens.findIndex((t, i) => t !== want.tokens[i])
  const at = first < 0 ? n : first
  let diff = 0
  for (let i = 0; i < Math.min(at + 1, n); i++) diff = Math.max(diff, maxDiff(got.logits[i]!, want.logits[i]!))
  return { at, diff, margin: at < n ? top2(want.logits[at]!).margin : undefined }
}

/** `f` on the shards in `dir`, opened, then released however `f` ends. */
export async function withPipeline<T> (dir: string, m: ShardManifest, f: (p: Pipeline) => Promise<T>): Promise<T> {
  const p = await openPipeline(dir, m)
  try { return await f(p) } finally { await p.release() }
}

/**
 * `f` for every test architecture's tiny model (seed 4), generated under a temporary directory
 * (removed after), with TEST_PROMPT encoded by its tokenizer; `f` compiles its shards under `root`.
 */
export async function eachTestModel (prefix: string, f: (arch: TestArchitecture, modelDir: string, prompt: number[], root: string) => Promise<void>): Promise<void> {
  const root = await mkdtemp(join(tmpdir(), prefix))
  try {
    for (const arch of TEST_ARCHITECTURES) {
      const modelDir = join(root, arch)
      await generateTestModel({ architecture: arch, outDir: modelDir, seed: 4 })
      await f(arch, modelDir, await encodePrompt(modelDir, TEST_PROMPT), root)
    }
  } finally {
    await rm(root, { recursive: true, force: true })
  }
}

/** The rows of a mixed-length batch for batchedAgainstAlone: prefixes of 4, 9 and 1 tokens, and the whole prompt. */
export const raggedRows = (prompt: number[]): number[][] => [prompt.slice(0, 4), prompt.slice(0, 9), prompt, prompt.slice(0, 1)]

/** Whether two float arrays hold the same bits. */
export const sameBytes = (a: Float32Array, b: Float32Array): boolean =>
  Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(Buffer.from(b.buffer, b.byteOffset, b.byteLength))

/**
 * Right-padded batched decode against each row alone, for an in-place ('ort-contrib') graph: each
 * row prefilled and then decoded `steps` steps alone (feeding a fixed token), and all rows
 * together with their caches packed left-aligned into one [B, kvH, W, hd] block wider than any
 * row alone had (W a multiple of 16, as an engine's blocks: kv-block.ts, plus `extraWidth`).
 * Returns the "row b step k" whose logits were not bit-identical (none: batch-invariant).
 */
export async function batchedAgainstAlone (p: Pipeline, rows: number[][], steps: number, extraWidth: number): Promise<string[]> {
  const manifest = p.manifest
  const alone: Float32Array[][] = []
  const prefilled: Array<Map<string, ort.Tensor>> = []
  for (const row of rows) {
    let r = await stepRows(p, [row], [row.map((_, j) => j)], [row.map(() => 1)], emptyPast(manifest, 1))
    prefilled.push(r.present)
    const logits: Float32Array[] = []
    for (let k = 0; k < steps; k++) {
      r = await stepRows(p, [[7 + k]], [[row.length + k]], [new Array<number>(row.length + k + 1).fill(1)], r.present)
      logits.push(r.logits)
    }
    alone.push(logits)
  }
  const { numKvHeads: kvH, headDim: hd } = manifest.shape
  const P = Math.max(...rows.map(r => r.length))
  const W = alignColumns(P + steps) + extraWidth
  let past = new Map<string, ort.Tensor>()
  for (const name of prefilled[0]!.keys()) {
    // Padding must be finite: a one-position step reads it and masks it to exact zeros.
    const data = new Float32Array(rows.length * kvH * W * hd)
    rows.forEach((row, b) => {
      const src = prefilled[b]!.get(name)!
      const width = src.dims[2]!
      for (let h = 0; h < kvH; h++) data.set((src.data as Float32Array).subarray(h * width * hd, (h * width + row.length) * hd), (b * kvH + h) * W * hd)
    })
    past.set(name, new ort.Tensor('float32', data, [rows.length, kvH, W, hd]))
  }
  const V = manifest.shape.vocabSize
  const mismatches: string[] = []
  for (let k = 0; k < steps; k++) {
    const T = P + k + 1
    const r = await stepRows(p, rows.map(() => [7 + k]), rows.map(row => [row.length + k]),
      rows.map(row => Array.from({ length: T }, (_, j) => (j < row.length + k + 1 ? 1 : 0))), past)
    rows.forEach((_, b) => { if (!sameBytes(r.logits.subarray(b * V, (b + 1) * V), alone[b]![k]!)) mismatches.push(`row ${b} step ${k}`) })
    past = r.present
  }
  return mismatches
}

/** Greedy decode: prefill the prompt in one call, then one token per step. Returns tokens and each step's logits. */
export async function greedyDecode (p: Pipeline, prompt: number[], n: number): Promise<{ tokens: number[], logits: Float32Array[] }> {
  let past = emptyPast(p.manifest, 1)
  const tokens: number[] = []
  const all: Float32Array[] = []
  let input = prompt
  let P = 0
  for (let step = 0; step < n; step++) {
    const S = input.length
    const out = await runStages(p, { ids: input, pos: input.map((_, j) => P + j), mask: new Array<number>(P + S).fill(1), B: 1, S, T: P + S, keep: 1 }, past)
    past = out.present
    const logits = out.logits.data as Float32Array
    let best = 0
    for (let j = 1; j < logits.length; j++) if (logits[j]! > logits[best]!) best = j
    tokens.push(best)
    all.push(logits)
    P += S
    input = [best]
  }
  return { tokens, logits: all }
}

/** Every way to cut `layers` layers into `k` contiguous non-empty stages. */
export function allSplits (layers: number, k: number): Array<Array<[number, number]>> {
  if (k === 1) return [[[0, layers - 1]]]
  const out: Array<Array<[number, number]>> = []
  const rec = (start: number, left: number, acc: Array<[number, number]>): void => {
    if (left === 1) { out.push([...acc, [start, layers - 1]]); return }
    for (let end = start; end <= layers - left; end++) rec(end + 1, left - 1, [...acc, [start, end]])
  }
  rec(0, k, [])
  return out
}

/**
 * One prefill over `rows` (left-padded to equal length; position_ids count real tokens only)
 * with num_logits_to_keep = `keep` (0 = all). Returns logits [B, K, V] flattened, and K.
 */
export async function prefill (p: Pipeline, rows: number[][], keep: number): Promise<{ logits: Float32Array, kept: number }> {
  const B = rows.length
  const S = Math.max(...rows.map(r => r.length))
  const ids: number[] = []
  const pos: number[] = []
  const mask: number[] = []
  for (const r of rows) {
    const pad = S - r.length
    for (let j = 0; j < S; j++) {
      ids.push(j < pad ? 0 : r[j - pad]!)
      pos.push(j < pad ? 0 : j - pad)
      mask.push(j < pad ? 0 : 1)
    }
  }
  const { logits } = await runStages(p, { ids, pos, mask, B, S, T: S, keep }, emptyPast(p.manifest, B))
  return { logits: logits.data as Float32Array, kept: logits.dims[1]! }
}

/**
 * What this CPU's onnxruntime kernels do, asked by running them: two probes.
 *
 * Whether this CPU's onnxruntime MatMulNBits gives a row of an M-row run exactly the bits of its
 * one-row run. On AVX-512 VNNI it does; on AVX2-only CPUs MLAS computes one-row int4 runs with a
 * kernel of their own (blocks of 32–128, either accuracy level), whose rounding differs from the
 * M-row kernel's by a few 1e-6 — enough, over dozens of greedy steps, for a sequence batched with
 * others to part from its batch-of-one tokens at a near tie (docs/engine-notes.md, wave 7). The
 * daemon asks once when it serves an int4 model and says which holds in its 'model loaded' line;
 * the tests that promise bit-exact batching of int4 shards ask too.
 *
 * Which form of the one-position attention (shards/contract.ts DecodeAttentionForm) runs faster
 * here, timed: `shoal shard` and the benchmarks compile 'ort-contrib' shards with it (the daemon's
 * own cache compile does not: daemon/node/models.ts).
 *
 * Both probes run on a session worker (off-thread-sessions.ts), never on the caller's event loop.
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { availableParallelism, tmpdir } from 'node:os'
import { join } from 'node:path'
import * as ort from 'onnxruntime-node'
import type { DecodeAttentionForm, ModelShape } from '../../shards/contract.ts'
import { decodeAttentionNodes } from '../../shards/graph/attention.ts'
import { DT, GraphBuilder, MS_DOMAIN } from '../../shards/graph/builder.ts'
import { quantizeMatrix } from '../../shards/quant.ts'
import { createOffThreadSessions, type OffThreadSession } from './off-thread-sessions.ts'

export interface RowInvariance {
  /** A row's bits do not depend on how many rows share the run. */
  rowInvariant: boolean
  /** Largest |one-row − M-row| over the probe's outputs (0 when row-invariant). */
  maxDiff: number
}

/**
 * What batching promises int4 sequences on this CPU, as the daemon's 'model loaded' line and
 * `shoal doctor` both say it: every row's own bits, or its bits to rounding (ARCHITECTURE.md,
 * "Exactness under batching").
 */
export function int4BatchingVerdict (rows: RowInvariance): 'bit-exact' | 'exact to rounding' {
  return rows.rowInvariant ? 'bit-exact' : 'exact to rounding'
}

const memo = new Map<string, Promise<RowInvariance>>()

/**
 * One MatMulNBits (int4, K 256, N 384, `blockSize`, `accuracyLevel` 4 = int8 activations, 0 = f32)
 * run on 4 rows at once and on each alone, compared bit for bit. Memoized per process: the answer
 * is the CPU's and onnxruntime's, not the run's.
 */
export async function matMulNBitsRowInvariance (accuracyLevel: number, blockSize = 32): Promise<RowInvariance> {
  const key = `${accuracyLevel}/${blockSize}`
  let p = memo.get(key)
  if (p === undefined) {
    memo.set(key, p = probe(accuracyLevel, blockSize))
    p.catch(() => { memo.delete(key) }) // a failed probe (a full tmpdir, say) may be asked again
  }
  return await p
}

async function probe (accuracyLevel: number, blockSize: number): Promise<RowInvariance> {
  const K = 256
  const N = 384
  const M = 4
  // A fixed pseudo-random sequence: the verdict must not depend on the run.
  let s = 12345
  const rand = (): number => { s = (s * 1103515245 + 12345) % 2147483648; return s / 2147483648 - 0.5 }
  const dir = await mkdtemp(join(tmpdir(), 'shoal-kernel-probe-'))
  const host = createOffThreadSessions()
  try {
    const g = new GraphBuilder('model.onnx.data')
    const x = g.input('x', DT.FLOAT, ['m', K])
    const q = quantizeMatrix(Float32Array.from({ length: N * K }, rand), N, K, 4, blockSize)
    const blocks = Math.ceil(K / blockSize)
    const qw = g.weight('w.q', DT.UINT8, [N, blocks, blockSize / 2], q.data)
    const sc = g.weight('w.s', DT.FLOAT, [N * blocks], new Uint8Array(q.scales.buffer))
    g.output('y', g.op('MatMulNBits', '/probe', [x, qw, sc], { K, N, bits: 4, block_size: blockSize, accuracy_level: accuracyLevel }, MS_DOMAIN), DT.FLOAT, ['m', N])
    await writeFile(join(dir, 'model.onnx'), g.encode('probe', 'MatMulNBits row invariance'))
    await writeFile(join(dir, 'model.onnx.data'), Buffer.concat(g.data()))
    const session = await host.create(join(dir, 'model.onnx'), { threads: 1 })
    const X = Float32Array.from({ length: M * K }, () => 2 * rand())
    const all = (await session.run({ x: new ort.Tensor('float32', X, [M, K]) })).y!.data as Float32Array
    let maxDiff = 0
    for (let r = 0; r < M; r++) {
      const one = (await session.run({ x: new ort.Tensor('float32', X.slice(r * K, (r + 1) * K), [1, K]) })).y!.data as Float32Array
      for (let j = 0; j < N; j++) maxDiff = Math.max(maxDiff, Math.abs(one[j]! - all[r * N + j]!))
    }
    return { rowInvariant: maxDiff === 0, maxDiff }
  } finally {
    await host.close()
    await rm(dir, { recursive: true, force: true })
  }
}

export interface DecodeAttentionChoice {
  form: DecodeAttentionForm
  /** The grouped form's time over the per-head form's (geometric mean over the probe's cases): below 1, grouped is faster. */
  ratio: number
}

/** The grouped form is taken only this much faster: a near tie keeps 'per-head', the form of compilers 7–11. */
export const GROUPED_MARGIN = 0.97
/** The cases timed: one row over 128 columns (one stream), four rows over 256 (a few streams). */
const ATTENTION_CASES: ReadonlyArray<{ rows: number, width: number }> = [{ rows: 1, width: 128 }, { rows: 4, width: 256 }]
const PROBE_LAYERS = 4
const ROUNDS = 12
const RUNS_A_ROUND = 8

const formMemo = new Map<string, Promise<DecodeAttentionChoice>>()

/**
 * Times both forms of the one-position attention at the model's head shape — the compiler's own
 * nodes (decodeAttentionNodes), four layers in a row, with the engine's thread count — and picks
 * the faster. Why a timing, not a rule: on waves 18–19's AVX-512 Xeon the grouped form ran
 * 12–16 % faster (3.8 % a served 60m int4 token), on wave 12's Zen 4 the per-head form ~8 %. The
 * two alternate in rounds, so load from elsewhere falls on both, and each case's tenth-percentile
 * run decides (medians moved with load; docs/engine-notes.md, wave 19). Memoized per process and
 * shape.
 */
export async function decodeAttentionForm (shape: Pick<ModelShape, 'numHeads' | 'numKvHeads' | 'headDim'>, options: { threads?: number } = {}): Promise<DecodeAttentionChoice> {
  const threads = options.threads ?? availableParallelism()
  const key = `${shape.numHeads}/${shape.numKvHeads}/${shape.headDim}/${threads}`
  let p = formMemo.get(key)
  if (p === undefined) {
    formMemo.set(key, p = timeForms(shape, threads))
    p.catch(() => { formMemo.delete(key) })
  }
  return await p
}

/**
 * decodeAttentionForm for a compile: a failed probe (no temporary directory, say) costs speed,
 * not the compile — the per-head form of compilers 7–11, with the reason.
 */
export async function decodeAttentionOrPerHead (shape: Pick<ModelShape, 'numHeads' | 'numKvHeads' | 'headDim'>): Promise<DecodeAttentionChoice & { error?: string }> {
  try {
    return await decodeAttentionForm(shape)
  } catch (err) {
    return { form: 'per-head', ratio: Number.NaN, error: err instanceof Error ? err.message : String(err) }
  }
}

/** The decision alone (pure): grouped only when it is faster by GROUPED_MARGIN. */
export function chooseDecodeAttention (ratio: number): DecodeAttentionForm {
  return ratio <= GROUPED_MARGIN ? 'grouped' : 'per-head'
}

async function timeForms (shape: Pick<ModelShape, 'numHeads' | 'numKvHeads' | 'headDim'>, threads: number): Promise<DecodeAttentionChoice> {
  const { numHeads: H, numKvHeads: kvH, headDim: hd } = shape
  const forms: DecodeAttentionForm[] = ['per-head', 'grouped']
  let s = 4242
  const rand = (): number => { s = (s * 1103515245 + 12345) % 2147483648; return s / 2147483648 - 0.5 }
  const dir = await mkdtemp(join(tmpdir(), 'shoal-attention-probe-'))
  const host = createOffThreadSessions()
  try {
    const sessions: OffThreadSession[] = []
    for (const form of forms) {
      // Shapes and scalars only: inline constants, no external data to write.
      const g = new GraphBuilder('model.onnx.data')
      const k = g.input('k', DT.FLOAT, ['b', 1, kvH * hd])
      const v = g.input('v', DT.FLOAT, ['b', 1, kvH * hd])
      const bias = g.input('bias', DT.FLOAT, ['b', 1, 1, 'w'])
      const ones = g.input('ones', DT.FLOAT, ['w', 1])
      let x = g.input('q', DT.FLOAT, ['b', 1, H * hd])
      for (let l = 0; l < PROBE_LAYERS; l++) {
        const pk = g.input(`past_key.${l}`, DT.FLOAT, ['b', kvH, 'w', hd])
        const pv = g.input(`past_value.${l}`, DT.FLOAT, ['b', kvH, 'w', hd])
        const [context] = decodeAttentionNodes(g, shape, form, `/l${l}`, { q: x, k, v }, pk, pv, { bias, ones })
        // Each layer's query from the last one's output, as a stage's layers follow one another.
        x = g.op('Add', `/l${l}/Add`, [x, context!])
      }
      g.output('y', x, DT.FLOAT, ['b', 1, H * hd])
      const path = join(dir, `${form}.onnx`)
      await writeFile(path, g.encode('probe', `one-position attention, ${form}`))
      sessions.push(await host.create(path, { threads }))
    }
    /** One timing of every case: the grouped form's time over the per-head form's, their geometric mean. */
    const measure = async (): Promise<number> => {
      const ratios: number[] = []
      for (const { rows: b, width: w } of ATTENTION_CASES) {
        const f32 = (dims: number[], fill?: number): ort.Tensor => {
          const n = dims.reduce((a, d) => a * d, 1)
          return new ort.Tensor('float32', Float32Array.from({ length: n }, () => fill ?? rand()), dims)
        }
        const feeds: Record<string, ort.Tensor> = { q: f32([b, 1, H * hd]), k: f32([b, 1, kvH * hd]), v: f32([b, 1, kvH * hd]), bias: f32([b, 1, 1, w], 0), ones: f32([w, 1], 1) }
        for (let l = 0; l < PROBE_LAYERS; l++) { feeds[`past_key.${l}`] = f32([b, kvH, w, hd]); feeds[`past_value.${l}`] = f32([b, kvH, w, hd]) }
        const times: number[][] = [[], []]
        for (const session of sessions) await session.time(feeds, 2) // warm-up: first runs allocate
        for (let round = 0; round < ROUNDS; round++) {
          for (const i of round % 2 === 0 ? [0, 1] : [1, 0]) times[i]!.push(...await sessions[i]!.time(feeds, RUNS_A_ROUND))
        }
        ratios.push(low(times[1]!) / low(times[0]!))
      }
      return Math.exp(ratios.reduce((a, r) => a + Math.log(r), 0) / ratios.length)
    }
    // A per-head answer gets a second timing, and the lower ratio stands. Why: a neighbour busy
    // on one core slows the grouped form more (its products split across both threads), and
    // turned a 0.76–0.88 ratio into 1.02–1.03 in 2 of 4 probes (60m's head shape, this VM;
    // docs/engine-notes.md, wave 28); a shard keeps its form, so a burst of load at compile time
    // would cost its every step a few per cent. A CPU where per-head is faster says so twice.
    let ratio = await measure()
    if (chooseDecodeAttention(ratio) === 'per-head') ratio = Math.min(ratio, await measure())
    return { form: chooseDecodeAttention(ratio), ratio }
  } finally {
    await host.close()
    await rm(dir, { recursive: true, force: true })
  }
}

/** The tenth percentile: what a form takes when nothing else interferes (load from elsewhere only ever adds). */
function low (xs: number[]): number {
  const sorted = [...xs].sort((a, b) => a - b)
  return sorted[Math.floor(sorted.length / 10)]!
}

/**
 * Batch invariance of quantized shards. The default graphs (ort-contrib, per-row attention
 * lengths, right-padded rows) give every sequence of a ragged batch exactly its batch-of-one
 * tokens with int8 activations too, sharing every decode run. With the standard op table (left
 * padding), an int4 model compiled with f32 activations
 * (`accuracyLevel: 0`) gives every sequence of a ragged, left-padded batch exactly the greedy
 * tokens it gets alone, over whole 64-token sequences. With int8 activations (the default) a
 * padded batch would not — the activation quantization amplifies the padded attention's last-bit
 * differences (left-padding such a batch diverged at tokens 31 and 33) — so those shards batch
 * only sequences whose caches are equally long, unpadded, and stay exact too. The `small`
 * generated model is used because the tiny one's margins are too wide to show the difference.
 *
 * Bit-exactness with int8 activations also needs onnxruntime's MatMulNBits to give a row of a
 * batch the bits of its one-row run, which holds on AVX-512 VNNI CPUs and not on AVX2-only ones
 * (daemon/engine/kernel-probe.ts). Where the probe says it does not, these tests hold the batch to
 * what still holds — the same runs shared, and the batched picks, fed the batch-of-one tokens,
 * equal to them but for near ties — and say how many differed.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createOnnxruntimeBackend, createStageEngine, createStageRunner, GREEDY_PICK as GREEDY, stageInfoOf } from '../../daemon/engine/index.ts'
import type { BackendSession, BatchingStageEngine, StepOutput } from '../../daemon/engine/index.ts'
import { INPUT_IDS } from '../../shards/contract.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import { matMulNBitsRowInvariance } from '../../daemon/engine/index.ts'
import { greedyAlone, greedyTogether, tokenOf } from './greedy-batches.ts'

const TOKENS = 64
const prompts = [16, 17, 19, 23].map((n, i) => Array.from({ length: n }, (_, j) => 1 + ((i * 131 + j * 37) % 500)))

/**
 * Batched picks against batch-of-one tokens. The batched runs are fed the batch-of-one tokens
 * (teacher forcing), so each pick is compared on the same inputs and a difference cannot compound
 * into a different continuation. Where MatMulNBits at `accuracyLevel` is row-invariant on this CPU
 * every pick must be equal; otherwise rounding may flip a near tie (int8 activations amplify it:
 * 0–5 picks of 64 on an AVX2 EPYC), and at most one pick in four may differ — a wrong row or cache
 * would differ almost everywhere, the model being random.
 */
async function expectBatchOfOneTokens (together: number[][], alone: number[][], accuracyLevel: number, label: string): Promise<void> {
  const kernel = await matMulNBitsRowInvariance(accuracyLevel)
  if (kernel.rowInvariant) {
    expect(together).toEqual(alone)
    return
  }
  expect(kernel.maxDiff).toBeLessThan(1e-4)
  const differ = together.map((t, i) => t.filter((id, j) => id !== alone[i]![j]).length)
  console.warn(`[${label}] this CPU's MatMulNBits (accuracy level ${accuracyLevel}) rounds a one-row run differently from a batch (max |Δ| ${kernel.maxDiff.toExponential(2)}): ` +
    `batched picks that differ from batch-of-one, per sequence: ${differ.join(', ')} of ${together[0]!.length}`)
  for (const d of differ) expect(d).toBeLessThanOrEqual(Math.floor(together[0]!.length / 4))
}

describe('standard-op int4 shards with f32 activations under batching', () => {
  let root: string
  let engine: BatchingStageEngine

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-int4-batch-'))
    await generateTestModel({ architecture: 'llama', outDir: join(root, 'ckpt'), size: 'small' })
    const manifest = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard'), quant: 'int4', accuracyLevel: 0, opSet: 'standard' })
    expect(stageInfoOf(manifest).batchPadding).toBe('left')
    engine = createStageEngine({ graphPath: join(root, 'shard', ...manifest.stages[0]!.graph.split('/')), stage: stageInfoOf(manifest), threads: 1, maxSequences: 8 })
    await engine.start()
  }, 120_000)
  afterAll(async () => {
    await engine?.stop()
    if (root !== undefined) await rm(root, { recursive: true, force: true })
  })

  it('a ragged batch of four gives each sequence its batch-of-one greedy tokens, over 64 tokens', async () => {
    const alone: number[][] = []
    for (const p of prompts) alone.push(await greedyAlone(engine, p, TOKENS))
    expect(await greedyTogether(engine, prompts, TOKENS)).toEqual(alone)
  }, 120_000)
})

describe('standard-op int4 shards with int8 activations under batching', () => {
  let root: string
  let session: BackendSession
  let manifest: Awaited<ReturnType<typeof compileShards>>
  // Two prompts of one length (their caches stay equally long), two of others.
  const mixed = [16, 16, 19, 23].map((n, i) => Array.from({ length: n }, (_, j) => 1 + ((i * 131 + j * 37) % 500)))

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-int8act-batch-'))
    await generateTestModel({ architecture: 'llama', outDir: join(root, 'ckpt'), size: 'small' })
    manifest = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard'), quant: 'int4', opSet: 'standard' })
    session = await createOnnxruntimeBackend().load(join(root, 'shard', ...manifest.stages[0]!.graph.split('/')), { device: 'CPU', threads: 1 })
  }, 120_000)
  afterAll(async () => {
    await session?.close()
    if (root !== undefined) await rm(root, { recursive: true, force: true })
  })

  it('share runs only between equally long caches, unpadded, and give every sequence its batch-of-one tokens', async () => {
    const stage = stageInfoOf(manifest)
    expect(stage.batchPadding).toBe('equal')
    // Quantized shards from compilers before version 3 all had int8 activations, unrecorded.
    expect(stageInfoOf({ ...manifest, compilerVersion: 2, quantization: { kind: 'int4', blockSize: 32 } }).batchPadding).toBe('equal')
    // Every run's batch size, seen by the session.
    const rows: number[] = []
    const counted: BackendSession = { ...session, run: async (feeds) => { rows.push(feeds[INPUT_IDS]!.dims[0]!); return await session.run(feeds) } }
    const runner = createStageRunner({ session: counted, stage })
    const ids = (p: number[]): BigInt64Array => BigInt64Array.from(p, BigInt)
    const positions = (n: number, from = 0): BigInt64Array => BigInt64Array.from({ length: n }, (_, k) => BigInt(from + k))
    const token = (out: StepOutput): number => tokenOf(out)
    const alone: number[][] = []
    for (const [i, p] of mixed.entries()) {
      runner.open(`a${i}`)
      let t = token(await runner.step(`a${i}`, { kind: 'tokens', ids: ids(p) }, positions(p.length), 1, GREEDY))
      const got = [t]
      while (got.length < TOKENS) {
        t = token(await runner.step(`a${i}`, { kind: 'tokens', ids: ids([t]) }, positions(1, p.length + got.length - 1), 1, GREEDY))
        got.push(t)
      }
      alone.push(got)
      await runner.drop(`a${i}`, 'free')
    }
    rows.length = 0
    mixed.forEach((_, i) => { runner.open(`b${i}`) })
    const together: number[][] = mixed.map(() => [])
    let items = mixed.map((p, i) => ({ seqId: `b${i}`, input: { kind: 'tokens' as const, ids: ids(p) }, positions: positions(p.length), logitsToKeep: 1, pick: GREEDY }))
    for (let step = 0; step < TOKENS; step++) {
      const results = await runner.stepBatch(items)
      results.forEach((r, i) => {
        if (!('output' in r)) throw r.error
        together[i]!.push(token(r.output))
      })
      // Fed the batch-of-one tokens (see expectBatchOfOneTokens): equal to its own picks wherever those agree.
      items = mixed.map((p, i) => ({ seqId: `b${i}`, input: { kind: 'tokens' as const, ids: ids([alone[i]![step]!]) }, positions: positions(1, p.length + step), logitsToKeep: 1, pick: GREEDY }))
    }
    await expectBatchOfOneTokens(together, alone, 4, 'int4, standard ops, equal caches')
    // The two equally long sequences ran together every step; the others never joined anyone.
    expect(Math.max(...rows)).toBe(2)
    expect(rows.filter(n => n === 2)).toHaveLength(TOKENS)
  }, 120_000)
})

describe('default int4 shards (int8 activations, right-padded rows) under batching', () => {
  let root: string
  let session: BackendSession
  let manifest: Awaited<ReturnType<typeof compileShards>>

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-int4-right-'))
    await generateTestModel({ architecture: 'llama', outDir: join(root, 'ckpt'), size: 'small' })
    manifest = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard'), quant: 'int4' })
    session = await createOnnxruntimeBackend().load(join(root, 'shard', ...manifest.stages[0]!.graph.split('/')), { device: 'CPU', threads: 1 })
  }, 120_000)
  afterAll(async () => {
    await session?.close()
    if (root !== undefined) await rm(root, { recursive: true, force: true })
  })

  it('a ragged batch of four shares every decode run and gives each sequence its batch-of-one tokens, over 64 tokens', async () => {
    expect(manifest.opSet).toBe('ort-contrib')
    expect(manifest.quantization).toMatchObject({ kind: 'int4', activations: 'int8' })
    const stage = stageInfoOf(manifest)
    expect(stage.batchPadding).toBe('right')
    const rows: number[] = []
    const counted: BackendSession = { ...session, run: async (feeds) => { rows.push(feeds[INPUT_IDS]!.dims[0]!); return await session.run(feeds) } }
    const runner = createStageRunner({ session: counted, stage })
    const ids = (p: number[]): BigInt64Array => BigInt64Array.from(p, BigInt)
    const positions = (n: number, from = 0): BigInt64Array => BigInt64Array.from({ length: n }, (_, k) => BigInt(from + k))
    const alone: number[][] = []
    for (const [i, p] of prompts.entries()) {
      runner.open(`a${i}`)
      let t = tokenOf(await runner.step(`a${i}`, { kind: 'tokens', ids: ids(p) }, positions(p.length), 1, GREEDY))
      const got = [t]
      while (got.length < TOKENS) {
        t = tokenOf(await runner.step(`a${i}`, { kind: 'tokens', ids: ids([t]) }, positions(1, p.length + got.length - 1), 1, GREEDY))
        got.push(t)
      }
      alone.push(got)
      await runner.drop(`a${i}`, 'free')
    }
    rows.length = 0
    prompts.forEach((_, i) => { runner.open(`b${i}`) })
    const together: number[][] = prompts.map(() => [])
    let items = prompts.map((p, i) => ({ seqId: `b${i}`, input: { kind: 'tokens' as const, ids: ids(p) }, positions: positions(p.length), logitsToKeep: 1, pick: GREEDY }))
    for (let step = 0; step < TOKENS; step++) {
      const results = await runner.stepBatch(items)
      results.forEach((r, i) => {
        if (!('output' in r)) throw r.error
        together[i]!.push(tokenOf(r.output))
      })
      // Midway one sequence steps alone once (its row of the shared block is a view, not a copy),
      // then rejoins one position ahead of the others.
      // Fed the batch-of-one tokens (see expectBatchOfOneTokens): equal to its own picks wherever those agree.
      // (Sequence 1, one ahead after its solo step, is fed its own last pick once it runs past alone's.)
      const fed = (i: number): number => alone[i]![together[i]!.length - 1] ?? together[i]!.at(-1)!
      const next = prompts.map((p, i) => ({ seqId: `b${i}`, input: { kind: 'tokens' as const, ids: ids([fed(i)]) }, positions: positions(1, p.length + together[i]!.length - 1), logitsToKeep: 1, pick: GREEDY }))
      if (step === 20) {
        const [r] = await runner.stepBatch([next[1]!])
        if (r === undefined || !('output' in r)) throw new Error('solo step failed')
        together[1]!.push(tokenOf(r.output))
        next[1] = { ...next[1]!, input: { kind: 'tokens' as const, ids: ids([fed(1)]) }, positions: positions(1, prompts[1]!.length + together[1]!.length - 1) }
      }
      items = next
    }
    for (let i = 0; i < prompts.length; i++) await runner.drop(`b${i}`, 'free')
    await expectBatchOfOneTokens(together.map(t => t.slice(0, TOKENS)), alone, 4, 'int4, ort-contrib, right-padded rows')
    // Prefills (different lengths) ran alone; every decode step ran the whole ragged batch.
    expect(rows.filter(n => n === 4).length).toBeGreaterThanOrEqual(TOKENS - 2)
  }, 120_000)
})

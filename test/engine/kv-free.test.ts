/**
 * The runner keeps a left-aligned sequence's KV in place (a block with room that each step's new
 * columns are written into) and gives a block's memory back as soon as nothing refers to it
 * (kv-block freeBlock), while a block that a sequence or a kept prefix still uses stays intact;
 * every block is a multiple of 16 columns wide. Watched through the past tensors the real session
 * is fed (the runner's blocks themselves).
 */
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createOnnxruntimeBackend, createStageRunner, stageInfoOf } from '../../daemon/engine/index.ts'
import type { BackendSession, PrefixKeepingRunner, TensorMap } from '../../daemon/engine/index.ts'
import { alignColumns, blockCapacity, freeBlock, groupCapacity } from '../../daemon/engine/kv-block.ts'
import { GREEDY_PICK } from '../../daemon/engine/sampling.ts'
import type { BatchStepResult } from '../../daemon/engine/runner-sequences.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import { LOGITS, NEW_KV, newKeyName } from '../../shards/contract.ts'
import { buildTinyModel } from './tiny-model.ts'
import type { TinyModel } from './tiny-model.ts'

const PAST = 'past_key_values.0.key'

describe('KV blocks are kept in place and freed when nothing refers to them', () => {
  let model: TinyModel
  let runner: PrefixKeepingRunner
  /** The real session, its runs recorded. */
  let session: BackendSession
  /** The buffer behind each run's first past tensor, in run order (undefined: empty past). */
  const fed: Array<ArrayBuffer | undefined> = []
  /** What each run fetched. */
  const fetched: Array<readonly string[] | undefined> = []
  /** The width (columns) of each run's first past tensor. */
  const widths: number[] = []
  /** The rows of each run's first past tensor. */
  const rowsFed: number[] = []
  /** The buffer of each run's new_key_values output, in run order. */
  const outs: Array<ArrayBuffer | undefined> = []

  beforeAll(async () => {
    model = await buildTinyModel('llama')
    const real = await createOnnxruntimeBackend().load(model.graphPath, { device: 'CPU', threads: 1 })
    session = {
      ...real,
      async run (feeds, fetches): Promise<TensorMap> {
        const past = feeds[PAST]!.data
        fed.push(past.length === 0 ? undefined : past.buffer as ArrayBuffer)
        fetched.push(fetches)
        widths.push(feeds[PAST]!.dims[2]!)
        rowsFed.push(feeds[PAST]!.dims[0]!)
        const out = await real.run(feeds, fetches)
        outs.push(out[NEW_KV]?.data.buffer as ArrayBuffer | undefined)
        return out
      },
    }
    runner = createStageRunner({ session, stage: stageInfoOf(model.manifest), chunkSize: 8 })
  })
  afterAll(async () => { await model?.cleanup() })

  const ids = (n: number, salt: number): number[] => Array.from({ length: n }, (_, i) => (i * 31 + salt) % 400 + 5)
  const step = async (seqId: string, tokens: number[], from: number): Promise<void> => {
    await runner.step(seqId, { kind: 'tokens', ids: BigInt64Array.from(tokens, BigInt) }, BigInt64Array.from(tokens.map((_, i) => BigInt(from + i))), 1)
  }
  const detached = (t: ArrayBuffer | undefined): boolean => t!.detached
  const tokenOf = (r: BatchStepResult): number => {
    if (!('output' in r) || r.output.kind !== 'token') throw new Error(`expected a token, got ${JSON.stringify(r)}`)
    return r.output.id
  }

  it('writes each step into the same block until it outgrows it, fetches no present, and frees what it replaced', async () => {
    runner.open('a')
    await step('a', ids(20, 1), 0) // chunks of 8, 8, 4
    expect(fed.slice(-3)[0]).toBeUndefined() // the first chunk has no past
    const block = fed.at(-1)!
    expect(fed.at(-2)).toBe(block) // chunks 2 and 3 wrote into one block
    expect(fetched.at(-1)!.some(n => n.startsWith('present.'))).toBe(false)
    // One output carries every layer's new columns (compiler ≥ 8), not two a layer.
    expect(fetched.at(-1)).toEqual([LOGITS, NEW_KV])
    // Decode steps go on in the same block while it has room…
    const room = blockCapacity(8, model.manifest.shape.maxPositions)
    let at = 20
    while (at + 1 <= room) { await step('a', [7], at); at++; expect(fed.at(-1)).toBe(block) }
    // …and the step past it moves to a bigger block (one copy) and frees the old one.
    await step('a', [7], at); at++
    const live = fed.at(-1)!
    expect(live).not.toBe(block)
    expect(detached(block)).toBe(true)
    expect(detached(live)).toBe(false)

    // Keeping a prefix copies its columns out (a kept block is never written); the sequence's
    // block is then unreferenced and freed. A sequence opened from the kept prefix moves to a
    // block of its own at its first step, and that block is freed at its drop.
    const kept = await runner.retain('a', 'k1', 21)
    expect(kept.length).toBe(21)
    expect(detached(live)).toBe(true)
    runner.openFrom('b', 'k1', 21)
    runner.evict(['k1'])
    expect(runner.stats().keptBytes).toBe(0)
    await step('b', [9, 10], 21)
    const bBlock = fed.at(-1)!
    expect(detached(bBlock)).toBe(false)
    await runner.drop('b', 'free')
    expect(detached(bBlock)).toBe(true)
  })

  it('a new sequence keeps its first columns as the run output them; its next step moves them to a block with room and frees that output', async () => {
    runner.open('n')
    await step('n', ids(5, 4), 0) // one chunk: no block allocated, nothing copied
    const first = outs.at(-1)!
    expect(detached(first)).toBe(false)
    await step('n', [7], 5) // fed a block of its own with room, never the 5-column output
    expect(fed.at(-1)).not.toBe(first)
    expect(widths.at(-1)! % 16).toBe(0)
    expect(detached(first)).toBe(true)
    await runner.drop('n', 'free')
    // A sequence dropped after its prefill (a max_tokens-1 request) frees the output at once.
    runner.open('m')
    await step('m', ids(3, 5), 0)
    const only = outs.at(-1)!
    await runner.drop('m', 'free')
    expect(detached(only)).toBe(true)
    expect(runner.stats()).toMatchObject({ liveSequences: 0, kvBytes: 0 })
  })

  it('keeps a block two batched sequences share until both moved on', async () => {
    runner.open('x')
    runner.open('y')
    await step('x', ids(6, 2), 0)
    await step('y', ids(6, 3), 0)
    const xOwn = fed.at(-2)
    const pos = (p: number): BigInt64Array => BigInt64Array.of(BigInt(p))
    const res = await runner.stepBatch([
      { seqId: 'x', input: { kind: 'tokens', ids: BigInt64Array.of(11n) }, positions: pos(6), logitsToKeep: 1 },
      { seqId: 'y', input: { kind: 'tokens', ids: BigInt64Array.of(12n) }, positions: pos(6), logitsToKeep: 1 },
    ])
    expect(res.every(r => 'output' in r)).toBe(true)
    // The batch packed both rows into one new block (their own blocks are gone)…
    const shared = fed.at(-1)!
    expect(xOwn === undefined || detached(xOwn)).toBe(true)
    // …which x alone reads its row of in place while y still holds the other row.
    await step('x', [13, 14], 7)
    expect(fed.at(-1)).toBe(shared)
    await runner.drop('y', 'free')
    expect(detached(shared)).toBe(false) // x's row
    await runner.drop('x', 'free')
    expect(detached(shared)).toBe(true)
  })

  it('a batch whose members change keeps its block: a joiner takes a spare row, a leaver\'s row is refilled, one that skips a step moves aside', async () => {
    // Three open when the pair first batches: a block of three rows (kv-rows.ts rowCapacity); s opens later.
    const names = ['p', 'q', 'r', 's']
    const prefill = async (n: string): Promise<void> => { runner.open(n); await step(n, ids(6, 10 + names.indexOf(n)), 0) }
    for (const n of names.slice(0, 3)) await prefill(n)
    const at = new Map(names.map(n => [n, 6]))
    const batch = async (who: string[]): Promise<void> => {
      const res = await runner.stepBatch(who.map(n => ({ seqId: n, input: { kind: 'tokens', ids: BigInt64Array.of(7n) }, positions: BigInt64Array.of(BigInt(at.get(n)!)), logitsToKeep: 1 })))
      expect(res.every(r => 'output' in r)).toBe(true)
      for (const n of who) at.set(n, at.get(n)! + 1)
    }
    await batch(['p', 'q']) // packed: a new block with a spare row (kv-rows.ts rowCapacity)
    const shared = fed.at(-1)!
    await batch(['p', 'q', 'r']) // r joins into the spare row
    expect(fed.at(-1)).toBe(shared)
    expect(rowsFed.at(-1)).toBe(3)
    await runner.drop('q', 'free')
    await batch(['p', 'r']) // r moves into q's row; the run is fed the first two rows
    expect(fed.at(-1)).toBe(shared)
    expect(rowsFed.at(-1)).toBe(2)
    await prefill('s')
    await batch(['r', 's', 'p']) // s joins, in any order
    expect(fed.at(-1)).toBe(shared)
    await batch(['p', 's']) // r, not stepping, is in the way and no row is spare: it moves to a block of its own
    expect(fed.at(-1)).toBe(shared)
    await step('r', [7], at.get('r')!); at.set('r', at.get('r')! + 1)
    expect(fed.at(-1)).not.toBe(shared)
    await batch(['s', 'r', 'p']) // and back
    expect(fed.at(-1)).toBe(shared)
    // A new sequence first in the group: its own one-row block ties with the shared one, which takes the run.
    runner.open('z'); await step('z', ids(6, 20), 0); at.set('z', 6)
    await batch(['z', 'p'])
    expect(fed.at(-1)).toBe(shared)
    expect(detached(shared)).toBe(false)
    for (const n of ['p', 'r', 's', 'z']) await runner.drop(n, 'free')
    expect(detached(shared)).toBe(true)
    expect(runner.stats()).toMatchObject({ liveSequences: 0, kvBytes: 0 })
  })

  it('a burst\'s first batch gets a row for every open sequence, so the others join without a repack', async () => {
    const names = ['b1', 'b2', 'b3', 'b4', 'b5']
    for (const [k, n] of names.entries()) { runner.open(n); await step(n, ids(6, 30 + k), 0) }
    const before = fed.length
    // They join one at a time, as a burst's prefills finish: two, then three, four, five.
    for (let n = 2, at = 6; n <= names.length; n++, at++) {
      const res = await runner.stepBatch(names.slice(0, n).map(s => ({ seqId: s, input: { kind: 'tokens', ids: BigInt64Array.of(7n) }, positions: BigInt64Array.of(BigInt(at)), logitsToKeep: 1 })))
      expect(res.every(r => 'output' in r)).toBe(true)
      // Those left out fall a step behind; feed them up to the same position.
      for (const s of names.slice(n)) await step(s, [7], at)
    }
    const groupRuns = fed.slice(before).filter((_, i) => rowsFed[before + i]! > 1)
    expect(new Set(groupRuns).size).toBe(1) // packed once, five rows (half as many again alone: 3, then 5)
    for (const n of names) await runner.drop(n, 'free')
  })

  it('a batch\'s block gets more room where one-position steps read live columns only (shoal\'s attention kernel)', async () => {
    const limit = model.manifest.shape.maxPositions
    expect(groupCapacity(129, limit)).toBe(224)
    expect(groupCapacity(1000, limit)).toBeLessThanOrEqual(alignColumns(1000 + 256 + Math.ceil(2 * Math.sqrt(1256))))
    expect(groupCapacity(limit, limit)).toBe(alignColumns(limit))
    for (const live of [false, true]) {
      const other = createStageRunner({ session: { ...session, liveColumnsOnly: live }, stage: stageInfoOf(model.manifest), chunkSize: 8 })
      for (const n of ['g1', 'g2']) { other.open(n); await other.step(n, { kind: 'tokens', ids: BigInt64Array.from(ids(6, 3), BigInt) }, BigInt64Array.from([0, 1, 2, 3, 4, 5], BigInt), 1) }
      await other.stepBatch(['g1', 'g2'].map(n => ({ seqId: n, input: { kind: 'tokens', ids: BigInt64Array.of(7n) }, positions: BigInt64Array.of(6n), logitsToKeep: 1 })))
      expect(widths.at(-1)).toBe(live ? groupCapacity(7, limit) : blockCapacity(7, limit))
      for (const n of ['g1', 'g2']) await other.drop(n, 'free')
    }
  })

  it('a batch\'s block has room for what its rows may reach (prompt and max_tokens), so it is not outgrown, and the tokens are the same', async () => {
    expect(groupCapacity(129, 4096, 256)).toBe(256) // a round of 128-token prompts and 128 tokens: no growth at 224
    expect(groupCapacity(129, 4096, 150)).toBe(groupCapacity(129, 4096)) // less than the default room: the default
    expect(groupCapacity(129, 4096, 100_000)).toBe(alignColumns(2 * 129 + 256)) // no max_tokens: at most twice and 256 more
    expect(groupCapacity(129, 200, 256)).toBe(alignColumns(200)) // never past the context
    expect(groupCapacity(1000, 4096, 1001)).toBe(groupCapacity(1000, 4096)) // never less than without it
    const limit = model.manifest.shape.maxPositions
    const reach = 60
    expect(limit).toBeGreaterThanOrEqual(reach)
    expect(groupCapacity(7, limit)).toBeLessThan(reach) // without the hint this block would grow
    const tokens: number[][] = []
    // Both rows hinted; neither; one only (a row without a reach may need any room: no hint then).
    for (const mode of ['none', 'both', 'one'] as const) {
      const hinted = mode === 'both'
      const other = createStageRunner({ session: { ...session, liveColumnsOnly: true }, stage: stageInfoOf(model.manifest), chunkSize: 8 })
      const names = ['h1', 'h2']
      const picked = names.map(() => [] as number[])
      for (const [i, n] of names.entries()) {
        other.open(n)
        const out = await other.stepBatch([{ seqId: n, input: { kind: 'tokens', ids: BigInt64Array.from(ids(6, 3 + i), BigInt) }, positions: BigInt64Array.from([0, 1, 2, 3, 4, 5], BigInt), logitsToKeep: 1, pick: GREEDY_PICK, ...(hinted || (mode === 'one' && i === 0) ? { reach } : {}) }])
        picked[i]!.push(tokenOf(out[0]!))
      }
      const before = fed.length
      for (let at = 6; at < reach; at++) {
        const out = await other.stepBatch(names.map((n, i) => ({ seqId: n, input: { kind: 'tokens', ids: BigInt64Array.of(BigInt(picked[i]!.at(-1)!)) }, positions: BigInt64Array.of(BigInt(at)), logitsToKeep: 1, pick: GREEDY_PICK })))
        out.forEach((r, i) => picked[i]!.push(tokenOf(r)))
      }
      const blocks = new Set(fed.slice(before))
      if (hinted) {
        expect(widths.slice(before)).toEqual(new Array(reach - 6).fill(alignColumns(reach)))
        expect(blocks.size).toBe(1) // packed once, never outgrown
      } else {
        expect(blocks.size).toBeGreaterThan(1)
      }
      tokens.push(picked.flat())
      for (const n of names) await other.drop(n, 'free')
    }
    expect(tokens[1]).toEqual(tokens[0])
    expect(tokens[2]).toEqual(tokens[0])
  })

  it('feeds every block a multiple of 16 columns wide (one-position attention is bit-stable only so)', () => {
    expect(widths.length).toBeGreaterThan(10)
    expect(widths.filter(w => w > 0 && w % 16 !== 0)).toEqual([])
    for (const limit of [16, 100, 2050, 4096]) {
      for (let need = 1; need <= limit; need++) {
        const c = blockCapacity(need, limit)
        if (c % 16 !== 0 || c < need || c > alignColumns(limit)) throw new Error(`blockCapacity(${need}, ${limit}) = ${c}`)
      }
    }
  })

  it('a graph of the older contract (two new-column outputs a layer, no new_key_values) runs with the same bits, batched too', async () => {
    const real = await createOnnxruntimeBackend().load(model.graphPath, { device: 'CPU', threads: 1 })
    try {
      const asked: Array<readonly string[] | undefined> = []
      const older: BackendSession = { ...real, outputNames: real.outputNames.filter(n => n !== NEW_KV), async run (feeds, fetches) { asked.push(fetches); return await real.run(feeds, fetches) } }
      const runners = [createStageRunner({ session: real, stage: stageInfoOf(model.manifest), chunkSize: 8 }), createStageRunner({ session: older, stage: stageInfoOf(model.manifest), chunkSize: 8 })]
      const logits: Float32Array[][] = [[], []]
      for (const [r, runner] of runners.entries()) {
        for (const id of ['x', 'y']) runner.open(id)
        let items = [{ seqId: 'x', n: 21, at: 0 }, { seqId: 'y', n: 5, at: 0 }]
        for (let round = 0; round < 12; round++) {
          const results = await runner.stepBatch(items.map(({ seqId, n, at }) => ({ seqId, input: { kind: 'tokens' as const, ids: BigInt64Array.from(ids(n, at + 3), BigInt) }, positions: BigInt64Array.from({ length: n }, (_, i) => BigInt(at + i)), logitsToKeep: 1 })))
          for (const res of results) {
            if (!('output' in res) || res.output.kind !== 'logits') throw new Error('expected logits')
            logits[r]!.push(res.output.data)
          }
          items = items.map(({ seqId, n, at }) => ({ seqId, n: 1, at: at + n }))
        }
      }
      expect(asked.at(-1)!.includes(newKeyName(model.manifest.stages[0]!.layers[0]))).toBe(true)
      expect(logits[1]!.length).toBe(logits[0]!.length)
      logits[0]!.forEach((row, i) => { expect(Buffer.from(logits[1]![i]!.buffer, logits[1]![i]!.byteOffset, logits[1]![i]!.byteLength).equals(Buffer.from(row.buffer, row.byteOffset, row.byteLength))).toBe(true) })
    } finally {
      await real.close()
    }
  })

  it('freeBlock leaves views of a larger buffer alone', () => {
    const whole = new Float32Array(16)
    const view = whole.subarray(4, 8)
    const own = new Float32Array(4)
    freeBlock({ rows: 1, total: 1, layers: [[{ type: 'float32', data: view, dims: [1, 1, 1, 4] }, { type: 'float32', data: own, dims: [1, 1, 1, 4] }]] })
    expect((whole.buffer as ArrayBuffer).detached).toBe(false)
    expect((own.buffer as ArrayBuffer).detached).toBe(true)
  })

  it('a context limit that is not a multiple of 16: blocks round up past it, and a sequence runs to its last position', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'shoal-odd-context-'))
    try {
      await generateTestModel({ architecture: 'llama', outDir: join(dir, 'ckpt'), size: 'tiny' })
      const config = JSON.parse(await readFile(join(dir, 'ckpt', 'config.json'), 'utf8')) as Record<string, unknown>
      await writeFile(join(dir, 'ckpt', 'config.json'), JSON.stringify({ ...config, max_position_embeddings: 100 }))
      const manifest = await compileShards({ modelDir: join(dir, 'ckpt'), outDir: join(dir, 'shard') })
      expect(manifest.shape.maxPositions).toBe(100)
      const real = await createOnnxruntimeBackend().load(join(dir, 'shard', ...manifest.stages[0]!.graph.split('/')), { device: 'CPU', threads: 1 })
      try {
        const seen: number[] = []
        const session: BackendSession = { ...real, async run (feeds, fetches) { seen.push(feeds[PAST]!.dims[2]!); return await real.run(feeds, fetches) } }
        const odd = createStageRunner({ session, stage: stageInfoOf(manifest), chunkSize: 8 })
        const run = async (tokens: number[], from: number): Promise<void> => {
          await odd.step('s', { kind: 'tokens', ids: BigInt64Array.from(tokens, BigInt) }, BigInt64Array.from(tokens.map((_, i) => BigInt(from + i))), 1)
        }
        odd.open('s')
        await run(ids(90, 4), 0) // chunks of 8 into blocks of up to 112 columns
        await run(ids(6, 5), 90) // a chunk over a past wider than the context (GroupQueryAttention)
        for (let at = 96; at < 100; at++) await run([7], at) // one-position steps to the last position
        expect(Math.max(...seen)).toBe(112)
        await expect(run([7], 100)).rejects.toThrow()
      } finally {
        await real.close()
      }
    } finally {
      await rm(dir, { recursive: true, force: true })
    }
  })
})

/**
 * The runner gives a KV block's memory back as soon as nothing refers to it (kv-block freeBlock):
 * each step's present outputs replace the previous block, whose buffers are then detached, while a
 * block that a sequence or a kept prefix still uses stays intact. Watched through the real
 * session's outputs (the runner's blocks are exactly those tensors).
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createOnnxruntimeBackend, createStageRunner, stageInfoOf } from '../../daemon/engine/index.ts'
import type { BackendSession, PrefixKeepingRunner, TensorMap } from '../../daemon/engine/index.ts'
import { freeBlock } from '../../daemon/engine/kv-block.ts'
import { buildTinyModel } from './tiny-model.ts'
import type { TinyModel } from './tiny-model.ts'

const PRESENT = 'present.0.key'

describe('KV blocks are freed when nothing refers to them', () => {
  let model: TinyModel
  let runner: PrefixKeepingRunner
  /** Each run's first present tensor, in run order. */
  const presents: Float32Array[] = []

  beforeAll(async () => {
    model = await buildTinyModel('llama')
    const real = await createOnnxruntimeBackend().load(model.graphPath, { device: 'CPU', threads: 1 })
    const session: BackendSession = {
      ...real,
      async run (feeds): Promise<TensorMap> {
        const out = await real.run(feeds)
        presents.push(out[PRESENT]!.data as Float32Array)
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
  const detached = (t: Float32Array): boolean => (t.buffer as ArrayBuffer).detached

  it('frees each replaced block, the last one at drop, and keeps what is still used', async () => {
    expect(presents[0]).toBeUndefined()
    runner.open('a')
    await step('a', ids(20, 1), 0) // chunks of 8, 8 (the last 4 stay whole)
    const prefill = presents.slice()
    expect(prefill.length).toBeGreaterThanOrEqual(2)
    // Every chunk's block but the last was replaced by the next one and freed.
    for (const t of prefill.slice(0, -1)) expect(detached(t)).toBe(true)
    expect(detached(prefill.at(-1)!)).toBe(false)
    await step('a', [7], 20)
    expect(detached(prefill.at(-1)!)).toBe(true)
    const live = presents.at(-1)!
    expect(detached(live)).toBe(false)

    // A kept prefix's block survives the sequence; a sequence opened from it shares it, and it is
    // freed only once neither the kept entry nor that sequence refers to it.
    const kept = await runner.retain('a', 'k1', 21)
    expect(kept.length).toBe(21)
    expect(detached(live)).toBe(false)
    runner.openFrom('b', 'k1', 21)
    runner.evict(['k1'])
    expect(detached(live)).toBe(false) // b still reads it
    await step('b', [9, 10], 21)
    expect(detached(live)).toBe(true)
    const bLast = presents.at(-1)!
    await runner.drop('b', 'free')
    expect(detached(bLast)).toBe(true)
  })

  it('keeps a block two batched sequences share until both moved on', async () => {
    runner.open('x')
    runner.open('y')
    await step('x', ids(6, 2), 0)
    await step('y', ids(6, 3), 0)
    const pos = (p: number): BigInt64Array => BigInt64Array.of(BigInt(p))
    const res = await runner.stepBatch([
      { seqId: 'x', input: { kind: 'tokens', ids: BigInt64Array.of(11n) }, positions: pos(6), logitsToKeep: 1 },
      { seqId: 'y', input: { kind: 'tokens', ids: BigInt64Array.of(12n) }, positions: pos(6), logitsToKeep: 1 },
    ])
    expect(res.every(r => 'output' in r)).toBe(true)
    const shared = presents.at(-1)!
    expect(shared.length).toBeGreaterThan(0)
    // x alone: the shared block is still y's.
    await step('x', [13, 14], 7)
    expect(detached(shared)).toBe(false)
    await runner.drop('y', 'free')
    expect(detached(shared)).toBe(true)
    await runner.drop('x', 'free')
  })

  it('freeBlock leaves views of a larger buffer alone', () => {
    const whole = new Float32Array(16)
    const view = whole.subarray(4, 8)
    const own = new Float32Array(4)
    freeBlock({ rows: 1, total: 1, layers: [[{ type: 'float32', data: view, dims: [1, 1, 1, 4] }, { type: 'float32', data: own, dims: [1, 1, 1, 4] }]] })
    expect((whole.buffer as ArrayBuffer).detached).toBe(false)
    expect((own.buffer as ArrayBuffer).detached).toBe(true)
  })
})

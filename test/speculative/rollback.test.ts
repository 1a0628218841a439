/**
 * The engine's rollback: a sequence set back to its first positions continues exactly as if the
 * rolled-back positions had never run — alone, from a shared batch block, through the worker —
 * and out-of-range rollbacks are refused.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createOnnxruntimeBackend, createStageEngine, createStageRunner, stageInfoOf } from '../../daemon/engine/index.ts'
import type { BackendSession, StageRunner, StepOutput } from '../../daemon/engine/index.ts'
import { buildTinyModel } from '../engine/tiny-model.ts'
import type { TinyModel } from '../engine/tiny-model.ts'

const ids = (xs: number[]): { kind: 'tokens', ids: BigInt64Array } => ({ kind: 'tokens', ids: BigInt64Array.from(xs, BigInt) })
const at = (from: number, n: number): BigInt64Array => BigInt64Array.from({ length: n }, (_, i) => BigInt(from + i))
const logits = (o: StepOutput): Float32Array => { if (o.kind !== 'logits') throw new Error(o.kind); return o.data }

describe('engine rollback', () => {
  let model: TinyModel
  let session: BackendSession
  let runner: StageRunner
  const prompt = [1, 50, 60, 70, 80]

  beforeAll(async () => {
    model = await buildTinyModel()
    session = await createOnnxruntimeBackend().load(model.graphPath, { device: 'CPU', threads: 1 })
    runner = createStageRunner({ session, stage: stageInfoOf(model.manifest) })
  })
  afterAll(async () => {
    await session?.close()
    await model?.cleanup()
  })

  /** Logits of `tail` after `prompt` on a fresh sequence. */
  async function fresh (tail: number[]): Promise<Float32Array> {
    runner.open('ref')
    try {
      await runner.step('ref', ids(prompt), at(0, prompt.length), 1)
      return logits(await runner.step('ref', ids(tail), at(prompt.length, tail.length), tail.length))
    } finally {
      await runner.drop('ref', 'free')
    }
  }

  it('continues as if the rolled-back positions never ran', async () => {
    runner.open('a')
    await runner.step('a', ids(prompt), at(0, prompt.length), 1)
    await runner.step('a', ids([9, 9, 9, 9]), at(prompt.length, 4), 4) // drafts that get rejected
    runner.rollback('a', prompt.length + 1) // keep the first
    expect(runner.stats().sequences.a).toBe(prompt.length + 1)
    const got = logits(await runner.step('a', ids([11, 12]), at(prompt.length + 1, 2), 2))
    expect([...got]).toEqual([...(await fresh([9, 11, 12])).subarray(512)])
    runner.rollback('a', prompt.length + 3) // no-op at the current length
    expect(() => { runner.rollback('a', prompt.length + 4) }).toThrow(/cannot roll back/)
    expect(() => { runner.rollback('nope', 1) }).toThrow(/unknown sequence/)
    await runner.drop('a', 'free')
  })

  it('rolled-back positions never push a later step past the context (solo and batched)', async () => {
    // A rollback leaves dead columns in a left-aligned block; fed whole, block + new positions
    // passed the graph's rotary table ("cos_cache dimension 0 shall not be less than
    // total_sequence_length") although the sequence itself fitted.
    const max = stageInfoOf(model.manifest).maxPositions
    const long = Array.from({ length: max - 7 }, (_, i) => (i * 7) % 500)
    const tail = [9, 11, 12, 13]
    const wholeRef = async (): Promise<Float32Array> => {
      runner.open('ref2')
      try {
        await runner.step('ref2', ids(long), at(0, long.length), 1)
        return logits(await runner.step('ref2', ids(tail), at(long.length, tail.length), tail.length))
      } finally { await runner.drop('ref2', 'free') }
    }
    const want = await wholeRef()
    runner.open('d')
    await runner.step('d', ids(long), at(0, long.length), 1)
    await runner.step('d', ids([9, 1, 2, 3, 4]), at(long.length, 5), 5) // the block now holds max - 2 columns
    runner.rollback('d', long.length + 1) // keep the first: 4 dead columns
    const got = logits(await runner.step('d', ids(tail.slice(1)), at(long.length + 1, 3), 3))
    expect([...got]).toEqual([...want.subarray(512)])
    await runner.drop('d', 'free')

    // Batched single-position steps feed a shared block as is: rows rolled back in it keep their
    // dead columns there the same way.
    const tail5 = [9, 11, 12, 13, 14]
    runner.open('ref3')
    await runner.step('ref3', ids(long), at(0, long.length), 1)
    const want5 = logits(await runner.step('ref3', ids(tail5), at(long.length, 5), 5))
    await runner.drop('ref3', 'free')
    runner.open('e')
    runner.open('f')
    for (const seqId of ['e', 'f']) await runner.step(seqId, ids(long), at(0, long.length), 1)
    for (const [i, t] of [9, 1, 2, 3].entries()) await runner.stepBatch(['e', 'f'].map(seqId => ({ seqId, input: ids([t]), positions: at(long.length + i, 1), logitsToKeep: 1 })))
    runner.rollback('e', long.length + 1)
    runner.rollback('f', long.length + 1)
    for (let i = 1; i < tail5.length; i++) {
      const outs = await runner.stepBatch(['e', 'f'].map(seqId => ({ seqId, input: ids([tail5[i]!]), positions: at(long.length + i, 1), logitsToKeep: 1 })))
      for (const r of outs) {
        expect('output' in r!, 'error' in r! ? String(r.error) : '').toBe(true)
        const row = 'output' in r! ? logits(r.output) : new Float32Array()
        // Batched runs are exact up to float rounding, not bit for bit.
        for (let j = 0; j < 512; j++) expect(row[j]).toBeCloseTo(want5[i * 512 + j]!, 4)
      }
    }
    await runner.drop('e', 'free')
    await runner.drop('f', 'free')
  })

  it('rolls back a row of a shared batch block without touching its batch-mates', async () => {
    runner.open('b')
    runner.open('c')
    await runner.stepBatch([
      { seqId: 'b', input: ids(prompt), positions: at(0, prompt.length), logitsToKeep: 1 },
      { seqId: 'c', input: ids(prompt), positions: at(0, prompt.length), logitsToKeep: 1 },
    ])
    await runner.stepBatch([
      { seqId: 'b', input: ids([9, 9, 9]), positions: at(prompt.length, 3), logitsToKeep: 3 },
      { seqId: 'c', input: ids([9, 11, 12]), positions: at(prompt.length, 3), logitsToKeep: 3 },
    ])
    runner.rollback('b', prompt.length + 1)
    const [rb, rc] = await runner.stepBatch([
      { seqId: 'b', input: ids([11]), positions: at(prompt.length + 1, 1), logitsToKeep: 1 },
      { seqId: 'c', input: ids([13]), positions: at(prompt.length + 3, 1), logitsToKeep: 1 },
    ])
    const want = await fresh([9, 11])
    const got = 'output' in rb! ? logits(rb.output) : new Float32Array()
    // Batched runs are exact up to float rounding (left padding), not bit for bit.
    for (let i = 0; i < 512; i++) expect(got[i]).toBeCloseTo(want[512 + i]!, 4)
    expect('output' in rc!).toBe(true)
    await runner.drop('b', 'free')
    await runner.drop('c', 'free')
  })

  it('goes through the worker protocol', async () => {
    const engine = createStageEngine({ graphPath: model.graphPath, stage: stageInfoOf(model.manifest), threads: 1 })
    await engine.start()
    try {
      const seq = await engine.open()
      await engine.step(seq, { tokenIds: [...prompt, 9, 9] }, [0, 1, 2, 3, 4, 5, 6])
      await engine.rollback(seq, prompt.length + 1)
      expect((await engine.stats()).sequences[seq]).toBe(prompt.length + 1)
      const got = logits(await engine.step(seq, { tokenIds: [11, 12] }, [6, 7], { logitsToKeep: 2 }))
      expect([...got]).toEqual([...(await fresh([9, 11, 12])).subarray(512)])
      await expect(engine.rollback(seq, 99)).rejects.toMatchObject({ code: 'SHOAL_ERR_ENGINE' })
    } finally {
      await engine.stop()
    }
  })
})

/**
 * Greedy verify steps checked in the engine worker (protocol.ts BatchStepItem.verify), on a tiny
 * fp32 shard: the verdict is greedyVerdict over the same step's logits, by e.step and by stepBatch;
 * the sequence then holds the step's first position and the accepted drafts' (the rejected ones
 * rolled back there, no rollback message), and what follows decodes as plain decoding does. With
 * `ahead` picks, a verdict that accepts nothing runs on ahead from its own token (the next steps
 * are taken as computed ahead), one that accepts any does not (runsAheadAfter). The boundary
 * checks what a verify may carry (token ids, or hidden states with their drafts). A chain's last
 * stage checks a greedy verify the same way: test/speculative/chain*.test.ts. No timings.
 */
import { describe, expect, it } from 'vitest'
import { GREEDY_PICK as GREEDY, greedyVerdict } from '../../daemon/engine/index.ts'
import type { StageBatchItem } from '../../daemon/engine/index.ts'
import { parseToWorker } from '../../daemon/engine/protocol.ts'
import { runsAheadAfter } from '../../daemon/engine/run-ahead.ts'
import { randomTokenIds, tinyEngineForSuite, tokenIdOf } from './tiny-model.ts'

describe('greedy verify steps checked in the engine worker', () => {
  const suite = tinyEngineForSuite({ threads: 1, maxSequences: 8 })

  /** A sequence prefilled with `prompt`; its first token. */
  async function prefilled (prompt: number[]): Promise<{ seq: string, first: number }> {
    const seq = await suite.engine.open()
    return { seq, first: tokenIdOf(await suite.engine.step(seq, { tokenIds: prompt }, prompt.map((_, i) => i), { pick: GREEDY })) }
  }

  /** `count` plain greedy steps from `token` at `at`; the tokens out. */
  async function plain (seq: string, token: number, at: number, count: number): Promise<number[]> {
    const out: number[] = []
    for (let i = 0; i < count; i++) {
      token = tokenIdOf(await suite.engine.step(seq, { tokenIds: [token] }, [at + i], { pick: GREEDY }))
      out.push(token)
    }
    return out
  }

  /** Drafts after a token whose plain continuation is `truth`: the first `good` right, then wrong ones (n in all). */
  const draftsOf = (truth: number[], good: number, n: number): number[] =>
    Array.from({ length: n }, (_, i) => i < good ? truth[i]! : (truth[i]! + 1) % suite.vocab)

  it('a verdict is greedyVerdict of the same step\'s logits, by step and by stepBatch, and the sequence keeps the accepted positions', async () => {
    const prompt = randomTokenIds(17, 1, suite.vocab)
    const ref = await prefilled(prompt)
    const truth = await plain(ref.seq, ref.first, prompt.length, 12)
    const at = prompt.length
    for (const [good, n] of [[0, 4], [2, 4], [4, 4], [1, 1], [0, 7]] as const) {
      const drafts = draftsOf(truth, good, n)
      const ids = [ref.first, ...drafts]
      const positions = ids.map((_, i) => at + i)
      // The logits a verify step gives, checked on the main thread as before.
      const byLogits = await prefilled(prompt)
      const logits = await suite.engine.step(byLogits.seq, { tokenIds: ids }, positions, { logitsToKeep: n + 1 })
      if (logits.kind !== 'logits') throw new Error('expected logits')
      const want = greedyVerdict(drafts, logits.data, logits.vocab)
      expect(want).toEqual({ accepted: good, next: truth[good]! })
      await suite.engine.free(byLogits.seq)

      const solo = await prefilled(prompt)
      expect(await suite.engine.step(solo.seq, { tokenIds: ids }, positions, { logitsToKeep: n + 1, verify: 'greedy' })).toEqual({ kind: 'verdict', accepted: want.accepted, id: want.next })
      const batched = await prefilled(prompt)
      const [r] = await suite.engine.stepBatch([{ seqId: batched.seq, input: { tokenIds: ids }, positions, logitsToKeep: n + 1, verify: 'greedy' }])
      expect(r !== undefined && 'output' in r && r.output).toEqual({ kind: 'verdict', accepted: want.accepted, id: want.next })
      for (const seq of [solo.seq, batched.seq]) {
        // The rejected positions are gone: the sequence holds the verified token and the accepted drafts.
        expect((await suite.engine.stats()).sequences[seq]).toBe(at + 1 + good)
        // And decodes on as plain decoding did.
        expect(await plain(seq, want.next, at + 1 + good, 12 - good - 1)).toEqual(truth.slice(good + 1))
        await suite.engine.free(seq)
      }
    }
    await suite.engine.free(ref.seq)
  })

  it('with ahead picks, a verdict that accepts nothing runs on ahead from its token; one that accepts any does not', async () => {
    const prompt = randomTokenIds(23, 2, suite.vocab)
    const ref = await prefilled(prompt)
    const truth = await plain(ref.seq, ref.first, prompt.length, 10)
    await suite.engine.free(ref.seq)
    const at = prompt.length
    for (const good of [0, 2]) {
      expect(runsAheadAfter(good)).toBe(good === 0)
      const { seq, first } = await prefilled(prompt)
      const drafts = draftsOf(truth, good, 3)
      const ids = [first, ...drafts]
      const item: StageBatchItem = { seqId: seq, input: { tokenIds: ids }, positions: ids.map((_, i) => at + i), logitsToKeep: 4, verify: 'greedy', ahead: [GREEDY, GREEDY, GREEDY] }
      const [v] = await suite.engine.stepBatch([item])
      expect(v !== undefined && 'output' in v && v.output).toEqual({ kind: 'verdict', accepted: good, id: truth[good] })
      // The steps after it, each handing the next picks on as a plain decode loop does.
      let token = truth[good]!
      const got: number[] = []
      const ranAhead: boolean[] = []
      for (let p = at + 1 + good; got.length < 10 - good - 1; p++) {
        const [r] = await suite.engine.stepBatch([{ seqId: seq, input: { tokenIds: [token] }, positions: [p], pick: GREEDY, ahead: [GREEDY, GREEDY, GREEDY] }])
        if (r === undefined || 'error' in r) throw r?.error ?? new Error('no result')
        token = tokenIdOf(r.output)
        got.push(token)
        ranAhead.push(r.ranAhead === true)
      }
      expect(got).toEqual(truth.slice(good + 1))
      // The first step after the verify was computed ahead only where nothing stood.
      expect(ranAhead[0]).toBe(good === 0)
      await suite.engine.free(seq)
    }
    expect((await suite.engine.stats()).liveSequences).toBe(0)
  })

  it('checks what a verify carries at the worker boundary', () => {
    const item = { seqId: 's', input: { kind: 'tokens', ids: BigInt64Array.of(5n, 6n, 7n) }, positions: BigInt64Array.of(7n, 8n, 9n), logitsToKeep: 3, verify: 'greedy' }
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [item] })).toMatchObject({ type: 'step-batch' })
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...item, ahead: [GREEDY] }] })).toMatchObject({ type: 'step-batch' })
    expect(parseToWorker({ type: 'step', id: 1, ...item })).toMatchObject({ type: 'step' })
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...item, verify: 'sampled' }] })).toMatch(/verify must be/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...item, pick: GREEDY }] })).toMatch(/no pick/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...item, logitsToKeep: 1 }] })).toMatch(/each of its/)
    // Hidden states (a chain's last stage) carry their drafts, one fewer than the positions, and run nothing ahead.
    const hidden = { ...item, input: { kind: 'hidden', data: new Float32Array(6) } }
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...hidden, drafts: [4, 9] }] })).toMatchObject({ type: 'step-batch' })
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [hidden] })).toMatch(/drafts/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...hidden, drafts: [4] }] })).toMatch(/drafts/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...hidden, drafts: [4, -1] }] })).toMatch(/drafts/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...hidden, drafts: [4, 9], ahead: [GREEDY] }] })).toMatch(/runs nothing ahead/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...item, drafts: [6, 7] }] })).toMatch(/drafts/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...item, verify: undefined, drafts: [6, 7] }] })).toMatch(/drafts go with a verify/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...item, ids: undefined, positions: BigInt64Array.of(7n), logitsToKeep: 1, input: { kind: 'tokens', ids: BigInt64Array.of(5n) } }] })).toMatch(/two or more/)
  })
})

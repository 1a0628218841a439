/**
 * Run-ahead in the engine worker (a tiny fp32 shard, ort-contrib ops): a decode step submitted with
 * `ahead` picks lets the worker feed back each token it picks without waiting for the main thread.
 * Every token taken from it equals the plain step's; the positions it computed beyond what the
 * caller took are never kept (retain) and are rolled back when the caller steps the sequence
 * otherwise; seeded sampling draws handed over in advance give the same tokens. Through the local
 * service, a stop string that lands while the worker is ahead gives the same completion, and the
 * next turn on the kept prefix the same tokens and the same reuse, as a service without run-ahead.
 * When the worker posts what it ran ahead (a short turn's tokens held for one more) is a pure
 * decision, checked apart. No timings.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLocalService, GREEDY_PICK as GREEDY } from '../../daemon/engine/index.ts'
import type { LocalService, StageBatchItem } from '../../daemon/engine/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { parseToWorker } from '../../daemon/engine/protocol.ts'
import type { WorkerTurn } from '../../daemon/engine/protocol.ts'
import { AHEAD_HOLD_MS, aheadPostDue, createRunAheadTracker } from '../../daemon/engine/run-ahead.ts'
import type { TokenPick } from '../../daemon/engine/sampling.ts'
import { buildTinyModel, randomTokenIds, tinyEngineForSuite, tokenIdOf } from './tiny-model.ts'
import type { TinyModel } from './tiny-model.ts'

const AHEAD = 4

describe('run-ahead in the engine worker', () => {
  const suite = tinyEngineForSuite({ threads: 1, maxSequences: 8 })

  /** One step of one sequence through stepBatch; `ranAhead` says whether the worker had it already. */
  async function step (seqId: string, fed: number[], at: number, pick: TokenPick, ahead?: TokenPick[]): Promise<{ id: number, ranAhead: boolean }> {
    const item: StageBatchItem = { seqId, input: { tokenIds: fed }, positions: fed.map((_, i) => at + i), pick, ...(ahead === undefined ? {} : { ahead }) }
    const [r] = await suite.engine.stepBatch([item])
    if (r === undefined || 'error' in r) throw r?.error ?? new Error('no result')
    runs.push(r.run)
    return { id: tokenIdOf(r.output), ranAhead: r.ranAhead === true }
  }
  /** Every step's worker turn, in order (`run` on its result). */
  const runs: Array<WorkerTurn | undefined> = []

  /** Prefill `prompt`, then `count` decode steps, each with the picks of the `ahead` steps after it (none: plain steps). */
  async function decode (seqId: string, prompt: number[], count: number, picks: (i: number) => TokenPick, ahead: number): Promise<{ ids: number[], ranAhead: number }> {
    let token = (await step(seqId, prompt, 0, picks(0))).id
    const ids = [token]
    let ranAhead = 0
    for (let i = 1; i <= count; i++) {
      const next = ahead === 0 ? undefined : Array.from({ length: ahead }, (_, k) => picks(i + 1 + k))
      const r = await step(seqId, [token], prompt.length + i - 1, picks(i), next)
      if (r.ranAhead) ranAhead++
      token = r.id
      ids.push(token)
    }
    return { ids, ranAhead }
  }

  /** Waits until the worker holds more than `length` positions of `seqId` (it has run ahead). */
  async function ranPast (seqId: string, length: number): Promise<number> {
    for (;;) {
      const held = (await suite.engine.stats()).sequences[seqId] ?? 0
      if (held > length) return held
      await new Promise(resolve => setTimeout(resolve, 2))
    }
  }

  it('gives the plain steps\' greedy tokens, most of them computed ahead', async () => {
    const prompt = randomTokenIds(20, 1, suite.vocab)
    const plainSeq = await suite.engine.open()
    const plain = await decode(plainSeq, prompt, 40, () => GREEDY, 0)
    const aheadSeq = await suite.engine.open()
    const ahead = await decode(aheadSeq, prompt, 40, () => GREEDY, AHEAD)
    expect(ahead.ids).toEqual(plain.ids)
    expect(plain.ranAhead).toBe(0)
    // The first decode step is a plain one (it starts the run-ahead); the worker may fall behind
    // the caller, never ahead of its picks.
    expect(ahead.ranAhead).toBeGreaterThan(30)
    // Each result names the worker turn that computed it, ahead or not: one row each here (one
    // sequence stepping), a prefill of 20 positions first, ids growing.
    const mine = runs.slice(-41)
    expect(mine.every(t => t !== undefined && t.ms > 0)).toBe(true)
    expect(mine.map(t => [t!.rows, t!.positions])).toEqual([[1, 20], ...Array.from({ length: 40 }, () => [1, 1])])
    expect(mine.every((t, i) => i === 0 || t!.id > mine[i - 1]!.id)).toBe(true)
    await suite.engine.free(plainSeq)
    await suite.engine.free(aheadSeq)
    expect((await suite.engine.stats()).liveSequences).toBe(0)
  })

  it('several sequences running ahead together, one joining late, each get their plain tokens', async () => {
    const prompts = [randomTokenIds(20, 11, suite.vocab), randomTokenIds(9, 12, suite.vocab), randomTokenIds(33, 13, suite.vocab)]
    const plain: number[][] = []
    for (const prompt of prompts) {
      const seq = await suite.engine.open()
      plain.push((await decode(seq, prompt, 24, () => GREEDY, 0)).ids)
      await suite.engine.free(seq)
    }
    // The worker merges the sequences' ahead steps (and the late one's prefill) into shared runs.
    const seqs = await Promise.all(prompts.map(async () => await suite.engine.open()))
    const late = new Promise(resolve => setTimeout(resolve, 5))
    const ahead = await Promise.all(prompts.map(async (prompt, i) => {
      if (i === 2) await late
      return (await decode(seqs[i]!, prompt, 24, () => GREEDY, AHEAD)).ids
    }))
    expect(ahead).toEqual(plain)
    for (const seq of seqs) await suite.engine.free(seq)
    expect((await suite.engine.stats()).liveSequences).toBe(0)
  })

  it('a prefill handed ahead picks runs on into the decode steps after it: the first is taken as computed ahead, with the plain tokens', async () => {
    const prompt = randomTokenIds(40, 3, suite.vocab)
    const draws = Array.from({ length: 64 }, (_, i) => ((i * 4099 + 7) % 1000) / 1000)
    for (const pick of [() => GREEDY, (i: number): TokenPick => ({ temperature: 0.8, topP: 0.9, u: draws[i]! })]) {
      const plainSeq = await suite.engine.open()
      const plain = await decode(plainSeq, prompt, 16, pick, 0)
      const seq = await suite.engine.open()
      const picks = (from: number): TokenPick[] => Array.from({ length: AHEAD }, (_, k) => pick(from + k))
      let token = (await step(seq, prompt, 0, pick(0), picks(1))).id
      // The worker ran past the prompt without being asked.
      expect(await ranPast(seq, prompt.length)).toBeGreaterThan(prompt.length)
      const ids = [token]
      const ranAhead: boolean[] = []
      for (let i = 1; i <= 16; i++) {
        const r = await step(seq, [token], prompt.length + i - 1, pick(i), picks(i + 1))
        ranAhead.push(r.ranAhead)
        token = r.id
        ids.push(token)
      }
      expect(ids).toEqual(plain.ids)
      expect(ranAhead[0]).toBe(true)
      await suite.engine.free(plainSeq)
      await suite.engine.free(seq)
    }
    expect((await suite.engine.stats()).liveSequences).toBe(0)
  })

  it('gives seeded sampling\'s tokens with the draws handed over in advance', async () => {
    const prompt = randomTokenIds(16, 2, suite.vocab)
    // One draw per step, by step index: what a sequence's generator yields in order.
    const draws = Array.from({ length: 64 }, (_, i) => ((i * 7919 + 13) % 1000) / 1000)
    const pick = (i: number): TokenPick => ({ temperature: 0.9, topP: 0.95, u: draws[i]! })
    const a = await suite.engine.open()
    const b = await suite.engine.open()
    const plain = await decode(a, prompt, 30, pick, 0)
    const ahead = await decode(b, prompt, 30, pick, AHEAD)
    expect(ahead.ids).toEqual(plain.ids)
    expect(new Set(plain.ids).size).toBeGreaterThan(5) // sampling, not a greedy cycle
    await suite.engine.free(a)
    await suite.engine.free(b)
  })

  it('a stop while the worker is ahead: retain keeps only the positions the caller fed, and a sequence opened from that prefix continues as without run-ahead', async () => {
    const prompt = randomTokenIds(24, 3, suite.vocab)
    const plainSeq = await suite.engine.open()
    const plain = await decode(plainSeq, prompt, 10, () => GREEDY, 0)
    const aheadSeq = await suite.engine.open()
    const ahead = await decode(aheadSeq, prompt, 10, () => GREEDY, AHEAD)
    expect(ahead.ids).toEqual(plain.ids)
    const fed = prompt.length + 10
    // The worker has computed steps nobody asked for yet.
    expect(await ranPast(aheadSeq, fed)).toBeLessThanOrEqual(fed + AHEAD)
    const keptPlain = await suite.engine.retain(plainSeq, 'plain', 10_000)
    const keptAhead = await suite.engine.retain(aheadSeq, 'ahead', 10_000)
    expect(keptPlain.length).toBe(fed)
    expect(keptAhead).toEqual(keptPlain)

    // Continue both prefixes with plain steps: the same tokens.
    const last = plain.ids.at(-1)!
    const cont = async (key: string): Promise<number[]> => {
      const seq = await suite.engine.openFrom(`${key}-next`, key, fed)
      let token = last
      const ids: number[] = []
      for (let i = 0; i < 12; i++) {
        token = (await step(seq, [token], fed + i, GREEDY)).id
        ids.push(token)
      }
      await suite.engine.free(seq)
      return ids
    }
    expect(await cont('ahead')).toEqual(await cont('plain'))
    await suite.engine.evict(['plain', 'ahead'])
    expect((await suite.engine.stats()).keptPrefixes).toBe(0)
  })

  it('a step other than the one the worker ran ahead rolls its positions back first', async () => {
    const prompt = randomTokenIds(18, 4, suite.vocab)
    const plainSeq = await suite.engine.open()
    const aheadSeq = await suite.engine.open()
    const plain = await decode(plainSeq, prompt, 6, () => GREEDY, 0)
    const ahead = await decode(aheadSeq, prompt, 6, () => GREEDY, AHEAD)
    expect(ahead.ids).toEqual(plain.ids)
    const at = prompt.length + 6
    await ranPast(aheadSeq, at)
    // Feed a token other than the one picked (the worker fed the picked one at `at`), then go on plainly.
    const forced = (plain.ids.at(-1)! + 1) % suite.vocab
    const go = async (seqId: string): Promise<number[]> => {
      const first = await step(seqId, [forced], at, GREEDY)
      expect(first.ranAhead).toBe(false)
      const ids = [first.id]
      for (let i = 1; i < 10; i++) ids.push((await step(seqId, [ids.at(-1)!], at + i, GREEDY)).id)
      return ids
    }
    expect(await go(aheadSeq)).toEqual(await go(plainSeq))
    const held = (await suite.engine.stats()).sequences
    expect(held[aheadSeq]).toBe(at + 10)
    expect(held[plainSeq]).toBe(at + 10)
    await suite.engine.free(plainSeq)
    await suite.engine.free(aheadSeq)
  })

  it('a cancelled wait for a step run ahead drops the sequence', async () => {
    const prompt = randomTokenIds(12, 5, suite.vocab)
    const seq = await suite.engine.open()
    const { ids } = await decode(seq, prompt, 3, () => GREEDY, AHEAD)
    const controller = new AbortController()
    controller.abort()
    const [r] = await suite.engine.stepBatch([{ seqId: seq, input: { tokenIds: [ids.at(-1)!] }, positions: [prompt.length + 3], pick: GREEDY, signal: controller.signal }])
    expect(r !== undefined && 'error' in r && (r.error as { code?: string }).code).toBe('SHOAL_ERR_ABORTED')
    expect((await suite.engine.stats()).sequences[seq]).toBeUndefined()
  })

  it('a wait for a step run ahead ends when either of its signals aborts (the batch\'s or the request\'s), and takes the token otherwise', async () => {
    const tracker = createRunAheadTracker({ maxPositions: 64, post: () => {} })
    const item = (position: number): StageBatchItem => ({ seqId: 's', input: { tokenIds: [7] }, positions: [position], pick: GREEDY, ahead: [GREEDY, GREEDY] })
    for (const which of [0, 1]) {
      const signals = [new AbortController(), new AbortController()]
      // The step fed at 10 goes to the worker, which runs the ones fed at 11 and 12 ahead.
      expect(tracker.start(item(10))).toHaveLength(2)
      const waiting = tracker.take(item(11), signals.map(c => c.signal))
      signals[which]!.abort()
      const r = await waiting
      expect(r !== undefined && 'error' in r && (r.error as { code?: string }).code).toBe('SHOAL_ERR_ABORTED')
    }
    const quiet = [new AbortController().signal, new AbortController().signal]
    tracker.start(item(20))
    const waiting = tracker.take(item(21), quiet)
    tracker.onAhead({ type: 'ahead', results: [{ seqId: 's', position: 21, fed: 7, token: 42 }] })
    expect(await waiting).toEqual({ output: { kind: 'token', id: 42 }, ranAhead: true })
  })

  it('checks ahead picks at the worker boundary', () => {
    const item = { seqId: 's', input: { kind: 'tokens', ids: BigInt64Array.of(5n) }, positions: BigInt64Array.of(7n), logitsToKeep: 1, pick: GREEDY }
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...item, ahead: [GREEDY, GREEDY] }] })).toMatchObject({ type: 'step-batch' })
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...item, ahead: [{ temperature: 0, topP: 1, u: 2 }] }] })).toMatch(/u in/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ ...item, pick: undefined, ahead: [GREEDY] }] })).toMatch(/ahead needs/)
    expect(parseToWorker({ type: 'ahead-picks', id: 2, items: [{ seqId: 's', from: 9, picks: [GREEDY] }] })).toMatchObject({ type: 'ahead-picks' })
    expect(parseToWorker({ type: 'ahead-picks', id: 2, items: [{ seqId: '', from: 9, picks: [] }] })).toMatch(/seqId/)
    expect(parseToWorker({ type: 'ahead-picks', id: 2, items: [{ seqId: 's', from: -1, picks: [] }] })).toMatch(/from/)
  })
})

describe('when the worker posts the tokens it ran ahead (aheadPostDue)', () => {
  it('holds a short turn\'s tokens for one more turn, never two', () => {
    expect(aheadPostDue({ turnMs: 1.4, heldTurns: 1, waiting: false })).toBe(false)
    expect(aheadPostDue({ turnMs: 1.4, heldTurns: 2, waiting: false })).toBe(true)
    expect(aheadPostDue({ turnMs: 0, heldTurns: 3, waiting: false })).toBe(true)
  })

  it('posts at once after a long turn, or when a sequence cannot go on without the main thread', () => {
    expect(aheadPostDue({ turnMs: AHEAD_HOLD_MS, heldTurns: 1, waiting: false })).toBe(true)
    expect(aheadPostDue({ turnMs: 40, heldTurns: 1, waiting: false })).toBe(true)
    expect(aheadPostDue({ turnMs: 0.3, heldTurns: 1, waiting: true })).toBe(true)
    expect(aheadPostDue({ turnMs: Number.NaN, heldTurns: 1, waiting: false })).toBe(true)
  })
})

describe('run-ahead through the local service', () => {
  let model: TinyModel
  let on: LocalService
  let off: LocalService
  /** No prefix cache: finds the stop string without leaving a prefix in the two compared. */
  let ref: LocalService
  let counter = 0
  const request = (ids: number[], over: Partial<GenerateRequest> = {}): GenerateRequest => ({
    requestId: `ra-${++counter}`,
    model: model.manifest.modelId,
    prompt: { kind: 'tokens', ids },
    maxTokens: 48,
    sampling: { temperature: 0, topP: 1 },
    stop: [],
    deadline: Date.now() + 60_000,
    ...over,
  })
  async function collect (svc: LocalService, req: GenerateRequest): Promise<{ tokens: number[], text: string, end: Extract<GenerateEvent, { type: 'end' }> | undefined }> {
    const events: GenerateEvent[] = []
    for await (const ev of svc.generate(req, new AbortController().signal)) events.push(ev)
    const deltas = events.filter((e): e is Extract<GenerateEvent, { type: 'delta' }> => e.type === 'delta')
    return { tokens: deltas.flatMap(d => d.tokenIds), text: deltas.map(d => d.text).join(''), end: events.find((e): e is Extract<GenerateEvent, { type: 'end' }> => e.type === 'end') }
  }

  beforeAll(async () => {
    model = await buildTinyModel()
    // Prefix reuse of generated tokens: what a stopped request leaves in the cache is visible.
    const init = { shardDir: model.shardDir, threads: 1, maxSequences: 4, prefixBlockSize: 8, reuseGenerated: true }
    on = createLocalService(init)
    off = createLocalService({ ...init, runAhead: 0 })
    ref = createLocalService({ shardDir: model.shardDir, threads: 1, kvCacheBytes: 0, runAhead: 0 })
    await on.start()
    await off.start()
    await ref.start()
  }, 120_000)
  afterAll(async () => {
    await on?.stop()
    await off?.stop()
    await ref?.stop()
    await model?.cleanup()
  })

  it('a stop string landing while the worker is ahead: the same completion, and the next turn reuses the same prefix and gives the same tokens', async () => {
    const vocab = model.manifest.shape.vocabSize
    const prompt = randomTokenIds(20, 7, vocab)
    const free = await collect(ref, request(prompt))
    expect(free.text.length).toBeGreaterThan(24)
    // A stop string mid-completion: the worker has run up to four steps past it by then.
    const stop = free.text.slice(16, 19)
    const results = []
    for (const svc of [off, on]) {
      const stopped = await collect(svc, request(prompt, { stop: [stop] }))
      const before = (await svc.stats()).prefix!
      const next = await collect(svc, request([...prompt, ...stopped.tokens, ...randomTokenIds(5, 8, vocab)], { maxTokens: 16 }))
      const after = (await svc.stats()).prefix!
      results.push({ stopped, next: next.tokens, missed: after.missTokens - before.missTokens, hit: after.hitTokens - before.hitTokens })
      expect((await svc.stats()).engine).toMatchObject({ liveSequences: 0 })
    }
    const [plain, ahead] = results
    expect(plain!.stopped.end?.finishReason).toBe('stop')
    expect(plain!.stopped.text).toBe(free.text.slice(0, free.text.indexOf(stop)))
    expect(ahead!.stopped).toEqual(plain!.stopped)
    expect(ahead!.hit).toBeGreaterThan(0)
    expect(ahead).toEqual(plain)
  })

  it('seeded sampling gives the same tokens with and without run-ahead', async () => {
    const prompt = randomTokenIds(16, 9, model.manifest.shape.vocabSize)
    const sampling = { temperature: 0.9, topP: 0.9, seed: 4321 }
    const a = await collect(off, request(prompt, { sampling }))
    const b = await collect(on, request(prompt, { sampling }))
    expect(b.tokens).toEqual(a.tokens)
    expect(b.tokens.length).toBe(48)
  })
})

/**
 * The benchmark's SimulatedEngine (reproduction/simulated-engine.ts) keeps the InferenceService
 * contract and the batching behaviour the replica benchmark relies on: deterministic tokens, at
 * most `slots` sequences at once, a bounded FIFO queue, slots freed at `end` (even when the
 * consumer never closes the generator), on abort, and while queued. No timing assertions.
 */
import { describe, expect, it } from 'vitest'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { createSimulatedEngine } from '../../reproduction/simulated-engine.ts'

const request = (id: string, text: string, maxTokens = 5): GenerateRequest => ({
  requestId: id, model: 'sim', prompt: { kind: 'text', text }, maxTokens, sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 60_000,
})

async function all (it: AsyncIterable<GenerateEvent>): Promise<GenerateEvent[]> {
  const out: GenerateEvent[] = []
  for await (const ev of it) out.push(ev)
  return out
}

describe('SimulatedEngine', () => {
  it('streams start, one token per delta and end; tokens are a function of the prompt', async () => {
    const e = createSimulatedEngine({ model: 'sim', nodeId: 'node-a', msPerToken: 1, slots: 2 })
    const a = await all(e.generate(request('1', 'hello'), new AbortController().signal))
    const b = await all(e.generate(request('2', 'hello'), new AbortController().signal))
    const c = await all(e.generate(request('3', 'other prompt'), new AbortController().signal))
    expect(a[0]).toMatchObject({ type: 'start', route: ['node-a'], receiptId: '1', promptTokenIds: [...new TextEncoder().encode('hello')] })
    expect(a.filter(x => x.type === 'delta')).toHaveLength(5)
    expect(a.at(-1)).toEqual({ type: 'end', finishReason: 'length', usage: { promptTokens: 5, completionTokens: 5 } })
    const ids = (evs: GenerateEvent[]): number[] => evs.flatMap(x => x.type === 'delta' ? x.tokenIds : [])
    expect(ids(b)).toEqual(ids(a))
    expect(ids(c)).not.toEqual(ids(a))
    expect(e.stats()).toMatchObject({ tokens: 15, completed: 3 })
    await expect(all(e.generate({ ...request('4', 'x'), model: 'nope' }, new AbortController().signal))).rejects.toMatchObject({ code: 'SHOAL_ERR_MODEL_NOT_FOUND' })
    e.stop()
  })

  it('runs at most `slots` sequences; the rest queue in order, and a full queue refuses', async () => {
    const e = createSimulatedEngine({ model: 'sim', nodeId: 'n', msPerToken: 1, slots: 2, maxQueue: 1 })
    const signal = new AbortController().signal
    const gens = ['a', 'b', 'c'].map(t => e.generate(request(t, t, 3), signal)[Symbol.asyncIterator]())
    const [s0, s1] = await Promise.all([gens[0]!.next(), gens[1]!.next()])
    expect(s0.value).toMatchObject({ type: 'start' })
    expect(s1.value).toMatchObject({ type: 'start' })
    const third = gens[2]!.next()
    let thirdStarted = false
    void third.then(() => { thirdStarted = true })
    await new Promise(resolve => setImmediate(resolve))
    expect(e.load()).toMatchObject({ inFlight: 2, queueDepth: 1, slots: 2, accepting: false })
    expect(thirdStarted).toBe(false)
    // The queue (1) is full: a fourth request is refused before start, retryably.
    await expect(e.generate(request('d', 'd'), signal)[Symbol.asyncIterator]().next()).rejects.toMatchObject({ code: 'SHOAL_ERR_OVERLOADED' })
    // Finish the first — without ever closing its generator after `end` — and the third starts.
    for (;;) { const r = await gens[0]!.next(); if (r.value?.type === 'end') break }
    expect((await third).value).toMatchObject({ type: 'start', receiptId: 'c' })
    expect(e.load()).toMatchObject({ inFlight: 2, queueDepth: 0 })
    await gens[1]!.return?.(undefined)
    await gens[2]!.return?.(undefined)
    expect(e.load()).toMatchObject({ inFlight: 0, queueDepth: 0, accepting: true })
    e.stop()
  })

  it('an abort frees the slot, and a queued request that is aborted leaves the queue', async () => {
    const e = createSimulatedEngine({ model: 'sim', nodeId: 'n', msPerToken: 1, slots: 1 })
    const running = new AbortController()
    const queued = new AbortController()
    const g1 = e.generate(request('1', 'a', 1000), running.signal)[Symbol.asyncIterator]()
    await g1.next()
    const g2 = e.generate(request('2', 'b', 3), queued.signal)[Symbol.asyncIterator]()
    const p2 = g2.next()
    await new Promise(resolve => setImmediate(resolve))
    expect(e.load().queueDepth).toBe(1)
    queued.abort(new Error('client left'))
    await expect(p2).rejects.toThrow('client left')
    expect(e.load().queueDepth).toBe(0)
    const p1 = (async () => { for (;;) { const r = await g1.next(); if (r.done === true) return } })()
    running.abort(new Error('cancelled'))
    await expect(p1).rejects.toThrow('cancelled')
    expect(e.load()).toMatchObject({ inFlight: 0, queueDepth: 0 })
    expect((await all(e.generate(request('3', 'c', 2), new AbortController().signal))).at(-1)).toMatchObject({ type: 'end' })
    e.stop()
  })
})

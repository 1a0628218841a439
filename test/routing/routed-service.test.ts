/**
 * The routed InferenceService's own logic (choice, local vs forward, the one retry, affinity,
 * own-load bookkeeping) with SimulatedPeers standing in for peers. The same service over real
 * libp2p streams is in forward.test.ts.
 */
import { describe, expect, it } from 'vitest'
import { ShoalError } from '../../daemon/errors.ts'
import type { GenerateEvent, GenerateRequest, InferenceService } from '../../daemon/service.ts'
import { createRoutedService, PeerUnavailableError, RemoteError } from '../../daemon/routing/index.ts'
import type { Candidate, LoadSnapshot, RoutedServiceComponents } from '../../daemon/routing/index.ts'
import { SimulatedPeer } from '../support/simulated-peer.ts'

const NOW = 2_000_000
let seq = 0

function request (over: Partial<GenerateRequest> = {}): GenerateRequest {
  return {
    requestId: `rs-${++seq}`,
    model: 'sim-1',
    prompt: { kind: 'chat', messages: [{ role: 'user', content: 'hi' }] },
    maxTokens: 5,
    sampling: { temperature: 0, topP: 1 },
    stop: [],
    deadline: NOW + 60_000,
    ...over,
  }
}

function load (over: Partial<LoadSnapshot> = {}): LoadSnapshot {
  return { observedAt: NOW - 10, queueDepth: 0, inFlight: 0, slots: 4, tokensPerSecond: 100, ...over }
}

function cand (peerId: string, over: Partial<Candidate> = {}): Candidate {
  return { peerId, local: false, admitted: true, alive: true, wholeModel: true, load: load(), rttMs: 1, ...over }
}

async function collect (events: AsyncIterable<GenerateEvent>): Promise<GenerateEvent[]> {
  const out: GenerateEvent[] = []
  for await (const ev of events) out.push(ev)
  return out
}

async function failure (p: Promise<unknown>): Promise<ShoalError & { phase?: string }> {
  try {
    await p
  } catch (err) {
    return err as ShoalError
  }
  throw new Error('expected a failure')
}

/** Peers as plain services; `broken` ones fail like an unreachable peer would. */
function mesh (peers: Record<string, InferenceService | 'unreachable'>, candidates: Candidate[], extra: Partial<RoutedServiceComponents> = {}): RoutedServiceComponents & { forwarded: string[] } {
  const forwarded: string[] = []
  return {
    forwarded,
    candidates: () => candidates,
    forward: (peerId, req, signal) => {
      forwarded.push(peerId)
      const p = peers[peerId]
      if (p === undefined || p === 'unreachable') {
        return (async function * () { throw new PeerUnavailableError(`cannot dial ${peerId}`, peerId) })()
      }
      return p.generate(req, signal)
    },
    ...extra,
  }
}

const ids = (events: GenerateEvent[]): number[] => events.flatMap(e => e.type === 'delta' ? e.tokenIds : [])

describe('createRoutedService', () => {
  it('serves locally while the local engine has headroom, naming this node in the route', async () => {
    const local = new SimulatedPeer()
    const remote = new SimulatedPeer()
    const m = mesh({ r: remote }, [cand('r', { load: load({ tokensPerSecond: 1000 }) }), cand('me', { local: true })], { local })
    const routed = createRoutedService({ localPeerId: 'me', now: () => NOW }, m)
    const req = request()
    const events = await collect(routed.generate(req, new AbortController().signal))
    expect(events[0]).toMatchObject({ type: 'start', route: ['me'] })
    expect(ids(events)).toEqual(SimulatedPeer.tokensFor(req, 5))
    expect(local.calls).toEqual([req.requestId])
    expect(m.forwarded).toEqual([])
  })

  it('retries once, invisibly, when the first replica fails before start', async () => {
    const b = new SimulatedPeer()
    const m = mesh({ a: 'unreachable', b }, [cand('a'), cand('b', { load: load({ inFlight: 2 }) })])
    const routed = createRoutedService({ now: () => NOW, random: () => 0 }, m)
    const req = request()
    const events = await collect(routed.generate(req, new AbortController().signal))
    expect(m.forwarded).toEqual(['a', 'b'])
    expect(events.map(e => e.type)).toEqual(['start', 'delta', 'delta', 'delta', 'delta', 'delta', 'end'])
    expect(ids(events)).toEqual(SimulatedPeer.tokensFor(req, 5))
  })

  it('retries a local OVERLOADED on a peer', async () => {
    const local = new SimulatedPeer({ failBeforeStart: () => new ShoalError('SHOAL_ERR_OVERLOADED', 'queue full') })
    const remote = new SimulatedPeer()
    const m = mesh({ r: remote }, [cand('me', { local: true }), cand('r')], { local })
    const events = await collect(createRoutedService({ localPeerId: 'me', now: () => NOW }, m).generate(request(), new AbortController().signal))
    expect(events[0]).toMatchObject({ type: 'start' })
    expect(m.forwarded).toEqual(['r'])
  })

  it('retries only once', async () => {
    const m = mesh({ a: 'unreachable', b: 'unreachable', c: new SimulatedPeer() }, [cand('a'), cand('b'), cand('c')])
    const err = await failure(collect(createRoutedService({ now: () => NOW, random: () => 0 }, m).generate(request(), new AbortController().signal)))
    expect(err.code).toBe('SHOAL_ERR_PEER_UNAVAILABLE')
    expect(m.forwarded).toHaveLength(2)
  })

  it('does not retry errors that would repeat anywhere', async () => {
    const bad = { models: () => [], generate: () => (async function * (): AsyncGenerator<GenerateEvent> { throw new RemoteError({ name: 'ShoalError', code: 'SHOAL_ERR_CONTEXT_LENGTH', message: 'too long' }, 'before-start', 'a') })() }
    const m = mesh({ a: bad, b: new SimulatedPeer() }, [cand('a'), cand('b', { load: load({ inFlight: 3 }) })])
    const err = await failure(collect(createRoutedService({ now: () => NOW, random: () => 0 }, m).generate(request(), new AbortController().signal)))
    expect(err.code).toBe('SHOAL_ERR_CONTEXT_LENGTH')
    expect(m.forwarded).toEqual(['a'])
  })

  it('does not retry after start: the stream ends with the error', async () => {
    const halfway = {
      models: () => [],
      generate: () => (async function * (): AsyncGenerator<GenerateEvent> {
        yield { type: 'start', promptTokenIds: [1], route: ['a'], receiptId: 'x' }
        yield { type: 'delta', text: 'x', tokenIds: [9] }
        throw new ShoalError('SHOAL_ERR_PEER_LOST', 'gone')
      })(),
    }
    const m = mesh({ a: halfway, b: new SimulatedPeer() }, [cand('a'), cand('b', { load: load({ inFlight: 3 }) })])
    const seen: GenerateEvent[] = []
    const err = await failure((async () => { for await (const e of createRoutedService({ now: () => NOW, random: () => 0 }, m).generate(request(), new AbortController().signal)) seen.push(e) })())
    expect(err.code).toBe('SHOAL_ERR_PEER_LOST')
    expect(seen.map(e => e.type)).toEqual(['start', 'delta'])
    expect(m.forwarded).toEqual(['a'])
  })

  it('with no other replica to retry on, reports the first failure', async () => {
    const m = mesh({ a: 'unreachable' }, [cand('a')])
    const err = await failure(collect(createRoutedService({ now: () => NOW }, m).generate(request(), new AbortController().signal)))
    expect(err.code).toBe('SHOAL_ERR_PEER_UNAVAILABLE')
  })

  it('maps decisions to typed errors: overloaded 429, no eligible 503, unknown model 404', async () => {
    const run = async (cs: Candidate[]): Promise<string | undefined> =>
      (await failure(collect(createRoutedService({ now: () => NOW }, mesh({}, cs)).generate(request(), new AbortController().signal)))).code
    expect(await run([cand('a', { load: load({ accepting: false }) })])).toBe('SHOAL_ERR_OVERLOADED')
    expect(await run([cand('a', { admitted: false })])).toBe('SHOAL_ERR_NO_ELIGIBLE_NODE')
    expect(await run([])).toBe('SHOAL_ERR_MODEL_NOT_FOUND')
  })

  it('sends the next turn of a conversation to the node that served its prefix', async () => {
    const a = new SimulatedPeer()
    const b = new SimulatedPeer()
    const m = mesh({ a, b }, [cand('a'), cand('b')])
    let r = 0
    // First draw picks a, later draws would pick b.
    const routed = createRoutedService({ now: () => NOW, random: () => (r++ === 0 ? 0 : 0.99) }, m)
    const turn1 = request({ prompt: { kind: 'chat', messages: [{ role: 'system', content: 'terse' }, { role: 'user', content: 'hi' }] } })
    await collect(routed.generate(turn1, new AbortController().signal))
    const turn2 = request({ prompt: { kind: 'chat', messages: [{ role: 'system', content: 'terse' }, { role: 'user', content: 'hi' }, { role: 'assistant', content: 'hello' }, { role: 'user', content: 'more' }] } })
    await collect(routed.generate(turn2, new AbortController().signal))
    const other = request({ prompt: { kind: 'chat', messages: [{ role: 'system', content: 'chatty' }, { role: 'user', content: 'yo' }] } })
    await collect(routed.generate(other, new AbortController().signal))
    expect(m.forwarded).toEqual(['a', 'a', 'b'])
  })

  it('counts its own unreported dispatches, so a burst does not land on one node', async () => {
    const release = Promise.withResolvers<void>()
    const held = (): SimulatedPeer => new SimulatedPeer({ holdBeforeStart: async () => await release.promise })
    const m = mesh({ a: held(), b: held(), c: held() }, [cand('a'), cand('b'), cand('c')])
    // random() = 0 always draws the pair (a, b): without bookkeeping all three would go to a.
    const routed = createRoutedService({ now: () => NOW, random: () => 0 }, m)
    const runs = [0, 1, 2].map(() => collect(routed.generate(request(), new AbortController().signal)))
    await new Promise(resolve => setImmediate(resolve))
    // a, then b (a now carries one more than it reported), then a again (a tie, first drawn wins).
    expect(routed.inFlight()).toEqual({ a: 2, b: 1 })
    release.resolve()
    await Promise.all(runs)
    expect(routed.inFlight()).toEqual({})
  })

  it('takes its own finished requests off a load report that still counts them', async () => {
    let clock = NOW
    // One slot each; the last reports (at NOW) show both full, `a` with our own first request.
    // `b` is faster, so on the reports alone `b` would win the second request.
    const table = [cand('a', { load: load({ observedAt: NOW, inFlight: 1, slots: 1, tokensPerSecond: 10 }) })]
    const m = mesh({ a: new SimulatedPeer(), b: new SimulatedPeer() }, table)
    const routed = createRoutedService({ now: () => clock, random: () => 0 }, m)
    // Our request to `a` was dispatched before the report and finishes after it.
    clock = NOW - 5
    const first = routed.generate(request(), new AbortController().signal)[Symbol.asyncIterator]()
    await first.next()
    expect(m.forwarded).toEqual(['a'])
    clock = NOW + 100
    while (!(await first.next()).done) { /* drain */ }
    table.push(cand('b', { load: load({ observedAt: NOW, inFlight: 1, slots: 1, tokensPerSecond: 1000 }) }))
    await collect(routed.generate(request(), new AbortController().signal))
    // Only our bookkeeping knows `a` has a free slot again.
    expect(m.forwarded).toEqual(['a', 'a'])
  })

  it('when a peer says how much of its load is ours, swaps that share for its exact own count', async () => {
    const release = Promise.withResolvers<void>()
    // One slot each; `a` is faster, so on the reports alone `a` wins every request.
    const table = [
      cand('a', { load: load({ observedAt: NOW, inFlight: 1, fromYou: 1, slots: 1, tokensPerSecond: 1000 }) }),
      cand('b', { load: load({ observedAt: NOW, inFlight: 0, fromYou: 0, slots: 1, tokensPerSecond: 10 }) }),
    ]
    const m = mesh({ a: new SimulatedPeer({ holdBeforeStart: async () => await release.promise }), b: new SimulatedPeer() }, table)
    const routed = createRoutedService({ now: () => NOW + 100, random: () => 0 }, m)
    // The report still counts our earlier request to `a`, which has finished: `a` is free.
    const first = collect(routed.generate(request(), new AbortController().signal))
    await new Promise(resolve => setImmediate(resolve))
    expect(m.forwarded).toEqual(['a'])
    // Now ours is on its way to `a`, dispatched before `a`'s next report but not yet counted by
    // it (fromYou 0, as if in transit): `a` is full, whatever the report's time says.
    table[0] = cand('a', { load: load({ observedAt: NOW + 200, inFlight: 0, fromYou: 0, slots: 1, tokensPerSecond: 1000 }) })
    await collect(routed.generate(request(), new AbortController().signal))
    expect(m.forwarded).toEqual(['a', 'b'])
    release.resolve()
    await first
  })

  it('merges local and mesh models', () => {
    const local = new SimulatedPeer({ model: 'm-local' })
    const routed = createRoutedService({ localPeerId: 'me' }, mesh({}, [], {
      local,
      meshModels: () => [
        { id: 'm-local', created: 1, ownedBy: 'x', contextLength: 4096, servedBy: ['p2'] },
        { id: 'm-remote', created: 1, ownedBy: 'x', contextLength: 2048, servedBy: ['p3'] },
      ],
    }))
    expect(routed.models().map(m => [m.id, m.servedBy])).toEqual([['m-local', ['me', 'p2']], ['m-remote', ['p3']]])
  })
})

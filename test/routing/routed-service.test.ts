/**
 * The routed InferenceService's own logic (choice, local vs forward, the one retry, affinity,
 * own-load bookkeeping) with SimulatedPeers standing in for peers. The same service over real
 * libp2p streams is in forward.test.ts.
 */
import { Registry } from 'prom-client'
import { describe, expect, it } from 'vitest'
import { createPrefixCache } from '../../daemon/kv/index.ts'
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

describe('createRoutedService: prefix-aware routing', () => {
  const scope = 'kv1/m/0-1/float32'
  const prompt = Array.from({ length: 300 }, (_, i) => 5 + (i * 13) % 97)
  const holdings = (kept: number[]): NonNullable<Candidate['prefixes']> => {
    const cache = createPrefixCache({ budgetBytes: 1 << 20 })
    cache.insert(scope, 'k', kept, 100)
    return { scope, blockSize: cache.blockSize, hashes: cache.summary(scope, 64) }
  }
  /** A peer that records the requests it receives. */
  const recording = (): InferenceService & { seen: GenerateRequest[] } => {
    const inner = new SimulatedPeer()
    const seen: GenerateRequest[] = []
    return { seen, models: () => inner.models(), generate: (req, signal) => { seen.push(req); return inner.generate(req, signal) } }
  }

  it('sends the prompt to the peer holding its prefix over an idle local engine, and counts it', async () => {
    const local = recording()
    const holder = recording()
    const metrics = new Registry()
    const m = mesh({ h: holder }, [cand('me', { local: true }), cand('h', { prefixes: holdings(prompt.slice(0, 256)) })], { local })
    const routed = createRoutedService({ localPeerId: 'me', now: () => NOW, metrics }, m)
    const events = await collect(routed.generate(request({ prompt: { kind: 'tokens', ids: prompt } }), new AbortController().signal))
    expect(events[0]).toMatchObject({ type: 'start' })
    expect(m.forwarded).toEqual(['h'])
    expect(holder.seen[0]!.prefixHolder).toBeUndefined()
    expect(await metrics.getSingleMetricAsString('shoal_routing_prefix_requests_total')).toMatch(/outcome="holder"} 1/)
  })

  it('without prefix routing the idle local engine wins, as before', async () => {
    const local = recording()
    const m = mesh({ h: recording() }, [cand('me', { local: true }), cand('h', { prefixes: holdings(prompt.slice(0, 256)) })], { local })
    const routed = createRoutedService({ localPeerId: 'me', now: () => NOW, prefixRouting: false }, m)
    await collect(routed.generate(request({ prompt: { kind: 'tokens', ids: prompt } }), new AbortController().signal))
    expect(m.forwarded).toEqual([])
    expect(local.seen).toHaveLength(1)
  })

  it('when the holder is overloaded the request runs elsewhere carrying the holder as its prefixHolder hint', async () => {
    const local = recording()
    const metrics = new Registry()
    const busy = cand('h', { prefixes: holdings(prompt.slice(0, 256)), load: load({ accepting: false, queueDepth: 10, inFlight: 4 }) })
    const m = mesh({ h: recording() }, [cand('me', { local: true }), busy], { local })
    const routed = createRoutedService({ localPeerId: 'me', now: () => NOW, metrics }, m)
    await collect(routed.generate(request({ prompt: { kind: 'tokens', ids: prompt } }), new AbortController().signal))
    expect(m.forwarded).toEqual([])
    expect(local.seen[0]!.prefixHolder).toEqual({ peerId: 'h', cachedTokens: 256 })
    expect(await metrics.getSingleMetricAsString('shoal_routing_prefix_requests_total')).toMatch(/outcome="elsewhere"} 1/)
  })

  it('tokenizes a chat prompt once through promptTokens, and only when some node keeps prefixes', async () => {
    const calls: string[] = []
    const promptTokens = async (req: GenerateRequest): Promise<number[]> => { calls.push(req.requestId); return prompt }
    const holder = recording()
    const m = mesh({ h: holder }, [cand('me', { local: true }), cand('h', { prefixes: holdings(prompt.slice(0, 256)) })], { local: recording(), promptTokens })
    const routed = createRoutedService({ localPeerId: 'me', now: () => NOW }, m)
    await collect(routed.generate(request(), new AbortController().signal))
    expect(calls).toHaveLength(1)
    expect(m.forwarded).toEqual(['h'])
    const none = mesh({ h: recording() }, [cand('me', { local: true }), cand('h')], { local: recording(), promptTokens })
    await collect(createRoutedService({ localPeerId: 'me', now: () => NOW }, none).generate(request(), new AbortController().signal))
    expect(calls).toHaveLength(1)
    // A tokenizer failure is not the request's: it routes without prefixes.
    const failing = mesh({ h: recording() }, [cand('me', { local: true }), cand('h', { prefixes: holdings(prompt.slice(0, 256)) })], { local: recording(), promptTokens: async () => { throw new Error('no tokenizer') } })
    await collect(createRoutedService({ localPeerId: 'me', now: () => NOW }, failing).generate(request(), new AbortController().signal))
    expect(failing.forwarded).toEqual([])
  })

  it('a prompt its own request just left on a peer counts as held there until the peer\'s reports catch up', async () => {
    const clock = NOW
    // Deterministic draws that alternate between the two peers (without what it learns, follow-ups would too).
    let r = 0
    const random = (): number => { r = (r + 0.37) % 1; return r }
    const empty = { scope, blockSize: 16, hashes: [] as string[] }
    /** A peer whose start event reports the prompt ids it ran (as a real executor does). */
    const executor = (): InferenceService & { seen: GenerateRequest[] } => {
      const inner = recording()
      return {
        seen: inner.seen,
        models: () => inner.models(),
        async * generate (req, signal) {
          for await (const ev of inner.generate(req, signal)) yield ev.type === 'start' && req.prompt.kind === 'tokens' ? { ...ev, promptTokenIds: req.prompt.ids } : ev
        },
      }
    }
    const peers = { g: executor(), h: executor() }
    // Neither peer's last report lists anything; both reports are older than what we will learn.
    const list = [cand('g', { prefixes: empty }), cand('h', { prefixes: empty })]
    const m = mesh(peers, list)
    const routed = createRoutedService({ now: () => clock, random }, m)
    for (let conversation = 0; conversation < 3; conversation++) {
      const first = Array.from({ length: 200 }, (_, i) => 7 + (i * 31 + conversation * 17) % 400)
      await collect(routed.generate(request({ prompt: { kind: 'tokens', ids: first } }), new AbortController().signal))
      const holder = m.forwarded.at(-1)!
      // The follow-up, sent at once: it goes where the first turn ran, whichever that was.
      for (let turn = 0; turn < 3; turn++) {
        await collect(routed.generate(request({ prompt: { kind: 'tokens', ids: [...first, ...Array.from({ length: 40 * (turn + 1) }, (_, i) => 9 + i)] } }), new AbortController().signal))
        expect(m.forwarded.at(-1)).toBe(holder)
      }
    }
  })
})

describe('the last node that could take a request (soleServer)', () => {
  const recording = (over: { failBeforeStart?: () => Error } = {}): InferenceService & { seen: GenerateRequest[] } => {
    const inner = new SimulatedPeer(over)
    const seen: GenerateRequest[] = []
    return { seen, models: () => inner.models(), generate: (req, signal) => { seen.push(req); return inner.generate(req, signal) } }
  }

  it('is told so when no other node serves the model, locally and forwarded', async () => {
    const local = recording()
    await collect(createRoutedService({ localPeerId: 'me', now: () => NOW }, mesh({}, [cand('me', { local: true })], { local })).generate(request(), new AbortController().signal))
    expect(local.seen[0]!.soleServer).toBe(true)
    const remote = recording()
    await collect(createRoutedService({ now: () => NOW }, mesh({ r: remote }, [cand('r')])).generate(request(), new AbortController().signal))
    expect(remote.seen[0]!.soleServer).toBe(true)
  })

  it('is not told so while another node could take the request, and the retry, the last one left, is', async () => {
    const local = recording({ failBeforeStart: () => new ShoalError('SHOAL_ERR_OVERLOADED', 'busy') })
    const remote = recording()
    const m = mesh({ r: remote }, [cand('me', { local: true }), cand('r', { load: load({ inFlight: 3 }) })], { local })
    await collect(createRoutedService({ localPeerId: 'me', now: () => NOW, random: () => 0 }, m).generate(request(), new AbortController().signal))
    expect(local.seen.map(r => r.soleServer)).toEqual([undefined])
    expect(remote.seen.map(r => r.soleServer)).toEqual([true])
  })
})

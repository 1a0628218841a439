/**
 * The forwarding client and server over real libp2p streams (TCP + noise + yamux on loopback),
 * with a SimulatedPeer behind the handler.
 */
import type { Libp2p } from '@libp2p/interface'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { httpStatusOf, ShoalError } from '../../daemon/errors.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import {
  createRoutedService, encodeFrame, forwardGenerate, handleInferStream, INFER_PROTOCOL, MAX_FRAME_BYTES,
} from '../../daemon/routing/index.ts'
import type { Candidate, ForwardError } from '../../daemon/routing/index.ts'
import { createTestNode, opener } from './nodes.ts'
import { SimulatedPeer } from '../support/simulated-peer.ts'

let seq = 0
function request (over: Partial<GenerateRequest> = {}): GenerateRequest {
  return {
    requestId: `req-${++seq}`,
    model: 'sim-1',
    prompt: { kind: 'chat', messages: [{ role: 'user', content: `hello ${seq}` }] },
    maxTokens: 12,
    sampling: { temperature: 0, topP: 1 },
    stop: [],
    deadline: Date.now() + 30_000,
    ...over,
  }
}

async function collect (events: AsyncIterable<GenerateEvent>): Promise<GenerateEvent[]> {
  const out: GenerateEvent[] = []
  for await (const ev of events) out.push(ev)
  return out
}

async function failure (p: Promise<unknown>): Promise<ForwardError> {
  try {
    await p
  } catch (err) {
    return err as ForwardError
  }
  throw new Error('expected a failure')
}

function tokenIds (events: GenerateEvent[]): number[] {
  return events.flatMap(ev => ev.type === 'delta' ? ev.tokenIds : [])
}

/** A node serving `service` on /shoal/infer/1.0.0. */
async function server (service: SimulatedPeer, transport: 'tcp' | 'quic' = 'tcp'): Promise<Libp2p> {
  const node = await createTestNode(transport)
  await node.handle(INFER_PROTOCOL, async (stream) => {
    await handleInferStream(stream, service, { localPeerId: node.peerId.toString() })
  })
  return node
}

describe('forwarding over libp2p', () => {
  let client: Libp2p
  const started: Libp2p[] = []
  const serve = async (service: SimulatedPeer): Promise<Libp2p> => {
    const node = await server(service)
    started.push(node)
    return node
  }

  beforeAll(async () => {
    client = await createTestNode()
  })
  afterAll(async () => {
    await Promise.all([client, ...started].map(async n => { await n.stop() }))
  })

  it('delivers start, every token in order, and end, equal to the service run locally', async () => {
    const service = new SimulatedPeer()
    const node = await serve(service)
    const req = request({ maxTokens: 40 })
    const events = await collect(forwardGenerate(opener(client, node, INFER_PROTOCOL), req, new AbortController().signal, { peerId: node.peerId.toString() }))
    const direct = await collect(new SimulatedPeer().generate(req, new AbortController().signal))

    expect(events[0]).toEqual({ type: 'start', promptTokenIds: [1, 2, 3], route: [node.peerId.toString()], receiptId: req.requestId })
    expect(events.slice(1)).toEqual(direct.slice(1))
    expect(tokenIds(events)).toEqual(SimulatedPeer.tokensFor(req, 40))
    expect(events.at(-1)).toEqual({ type: 'end', finishReason: 'length', usage: { promptTokens: 3, completionTokens: 40 } })
  })

  it('carries every prompt kind and sampling field intact', async () => {
    const service = new SimulatedPeer()
    const node = await serve(service)
    const req = request({ prompt: { kind: 'tokens', ids: [5, 0, 70000] }, sampling: { temperature: 0.7, topP: 0.9, seed: 42 }, stop: ['\n', 'END'], maxTokens: 3 })
    const events = await collect(forwardGenerate(opener(client, node, INFER_PROTOCOL), req, new AbortController().signal))
    expect(events[0]).toMatchObject({ type: 'start', promptTokenIds: [5, 0, 70000] })
    expect(tokenIds(events)).toEqual(SimulatedPeer.tokensFor(req, 3))
  })

  it('propagates cancel: the caller aborts mid-stream, the service sees its signal fire', async () => {
    const service = new SimulatedPeer({ msPerToken: 5, stallAfter: 3 })
    const node = await serve(service)
    const req = request({ maxTokens: 100 })
    const ctl = new AbortController()
    const seen: GenerateEvent[] = []
    const err = await failure((async () => {
      for await (const ev of forwardGenerate(opener(client, node, INFER_PROTOCOL), req, ctl.signal)) {
        seen.push(ev)
        if (ev.type === 'delta' && seen.length === 3) ctl.abort()
      }
    })())
    expect(err.code).toBe('SHOAL_ERR_ABORTED')
    expect(err.phase).toBe('after-start')
    expect(err.retryable).toBe(false)
    await service.aborted(req.requestId) // resolves only if the server side aborted the service
  })

  it('propagates cancel when the consumer stops iterating', async () => {
    const service = new SimulatedPeer({ stallAfter: 2 })
    const node = await serve(service)
    const req = request({ maxTokens: 100 })
    for await (const ev of forwardGenerate(opener(client, node, INFER_PROTOCOL), req, new AbortController().signal)) {
      if (ev.type === 'delta') break
    }
    await service.aborted(req.requestId)
  })

  it('turns an error frame before start into a typed, retryable-by-code error', async () => {
    const node = await serve(new SimulatedPeer())
    const notFound = await failure(collect(forwardGenerate(opener(client, node, INFER_PROTOCOL), request({ model: 'nope' }), new AbortController().signal)))
    expect(notFound).toMatchObject({ code: 'SHOAL_ERR_MODEL_NOT_FOUND', phase: 'before-start', retryable: true })

    const tooLong = new SimulatedPeer({ model: 'sim-2', failBeforeStart: () => new ShoalError('SHOAL_ERR_CONTEXT_LENGTH', 'prompt too long') })
    const node2 = await serve(tooLong)
    const ctx = await failure(collect(forwardGenerate(opener(client, node2, INFER_PROTOCOL), request({ model: 'sim-2' }), new AbortController().signal)))
    expect(ctx).toMatchObject({ code: 'SHOAL_ERR_CONTEXT_LENGTH', phase: 'before-start', retryable: false, message: 'prompt too long' })

    // The field the peer named (OpenAI's `param`) comes back too, so the client sees what the holder said.
    const tooMany = new SimulatedPeer({ model: 'sim-3', failBeforeStart: () => Object.assign(new ShoalError('SHOAL_ERR_BAD_REQUEST', 'max_tokens too large'), { param: 'max_tokens' }) })
    const node3 = await serve(tooMany)
    const bad = await failure(collect(forwardGenerate(opener(client, node3, INFER_PROTOCOL), request({ model: 'sim-3' }), new AbortController().signal)))
    expect(bad).toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST', param: 'max_tokens', retryable: false })
    expect(httpStatusOf(bad).status).toBe(400)
  })

  it('fails with SHOAL_ERR_DEADLINE when the deadline passes, and the service is stopped', async () => {
    const service = new SimulatedPeer({ stallAfter: 2 })
    const node = await serve(service)
    const req = request({ maxTokens: 100, deadline: Date.now() + 400 })
    const err = await failure(collect(forwardGenerate(opener(client, node, INFER_PROTOCOL), req, new AbortController().signal)))
    expect(err.code).toBe('SHOAL_ERR_DEADLINE')
    expect(err.retryable).toBe(false)
    await service.aborted(req.requestId)
  })

  it('refuses a request whose deadline has already passed, without dialing', async () => {
    let dialed = false
    const err = await failure(collect(forwardGenerate(async () => { dialed = true; throw new Error('unreachable') }, request({ deadline: Date.now() - 1 }), new AbortController().signal)))
    expect(err).toMatchObject({ code: 'SHOAL_ERR_DEADLINE', phase: 'before-start' })
    expect(dialed).toBe(false)
  })

  it('reports a silent peer after start as PEER_LOST (idle timeout), never hangs', async () => {
    const service = new SimulatedPeer({ stallAfter: 2 })
    const node = await serve(service)
    const req = request({ maxTokens: 100 })
    const events: GenerateEvent[] = []
    const err = await failure((async () => {
      for await (const ev of forwardGenerate(opener(client, node, INFER_PROTOCOL), req, new AbortController().signal, { idleTimeoutMs: 300 })) events.push(ev)
    })())
    expect(err).toMatchObject({ code: 'SHOAL_ERR_PEER_LOST', phase: 'after-start', retryable: false })
    expect(tokenIds(events)).toEqual(SimulatedPeer.tokensFor(req, 2))
    await service.aborted(req.requestId) // the client cancelled on its way out
  })

  it('once the mesh loses contact with the peer, a short silence ends the forward (not the idle bound)', async () => {
    const service = new SimulatedPeer({ stallAfter: 2 })
    const node = await serve(service)
    const req = request({ maxTokens: 100 })
    const lost = new AbortController()
    const events: GenerateEvent[] = []
    const err = await failure((async () => {
      // The idle bound alone would wait 10 minutes: only the loss signal can end this in time.
      for await (const ev of forwardGenerate(opener(client, node, INFER_PROTOCOL), req, new AbortController().signal, { idleTimeoutMs: 600_000, peerLost: lost.signal })) {
        events.push(ev)
        if (tokenIds(events).length === 2) lost.abort()
      }
    })())
    expect(err).toMatchObject({ code: 'SHOAL_ERR_PEER_LOST', phase: 'after-start', message: expect.stringMatching(/after the mesh lost contact/) })
    expect(tokenIds(events)).toEqual(SimulatedPeer.tokensFor(req, 2))
    await service.aborted(req.requestId)
  })

  it('a peer that keeps streaming is not cut off when the mesh loses contact with it', async () => {
    const node = await serve(new SimulatedPeer({ msPerToken: 20 }))
    const req = request({ maxTokens: 80 })
    const lost = new AbortController()
    lost.abort() // lost from the start: 80 tokens at 20 ms each outlast the short bound, but none is silent that long
    const events = await collect(forwardGenerate(opener(client, node, INFER_PROTOCOL), req, new AbortController().signal, { peerLost: lost.signal }))
    expect(tokenIds(events)).toEqual(SimulatedPeer.tokensFor(req, 80))
    expect(events.at(-1)?.type).toBe('end')
  })

  it('turns an error frame after start into a typed, non-retryable error', async () => {
    const node = await serve(new SimulatedPeer({ failAfter: { tokens: 2, error: () => new ShoalError('SHOAL_ERR_INTERNAL', 'engine crashed') } }))
    const req = request({ maxTokens: 10 })
    const events: GenerateEvent[] = []
    const err = await failure((async () => {
      for await (const ev of forwardGenerate(opener(client, node, INFER_PROTOCOL), req, new AbortController().signal)) events.push(ev)
    })())
    expect(err).toMatchObject({ code: 'SHOAL_ERR_INTERNAL', message: 'engine crashed', phase: 'after-start', retryable: false })
    expect(tokenIds(events)).toEqual(SimulatedPeer.tokensFor(req, 2))
  })

  it('reports a peer that never starts as PEER_UNAVAILABLE after the first-frame timeout, and cancels it', async () => {
    const service = new SimulatedPeer({ holdBeforeStart: async () => await new Promise(() => {}) })
    const node = await serve(service)
    const req = request()
    const err = await failure(collect(forwardGenerate(opener(client, node, INFER_PROTOCOL), req, new AbortController().signal, { firstFrameTimeoutMs: 300 })))
    expect(err).toMatchObject({ code: 'SHOAL_ERR_PEER_UNAVAILABLE', phase: 'before-start', retryable: true })
    // On a loaded machine the cancel can overtake the request, and then the server never calls the
    // service at all. Either way nothing may keep running there.
    const settled = await Promise.race([service.aborted(req.requestId).then(() => 'aborted'), new Promise(resolve => setTimeout(resolve, 10_000, 'timeout'))])
    if (settled !== 'aborted') expect(service.calls).not.toContain(req.requestId)
  })

  it('reports an unreachable peer as PEER_UNAVAILABLE (retryable)', async () => {
    const dead = await createTestNode()
    const open = opener(client, dead, INFER_PROTOCOL)
    await dead.stop()
    const err = await failure(collect(forwardGenerate(open, request(), new AbortController().signal)))
    expect(err).toMatchObject({ code: 'SHOAL_ERR_PEER_UNAVAILABLE', phase: 'before-start', retryable: true })
  })

  it('classifies a peer that speaks garbage as a wire error before start', async () => {
    const node = await createTestNode()
    started.push(node)
    await node.handle(INFER_PROTOCOL, (stream) => {
      // A frame of an unknown kind (9), then nothing.
      const payload = new Uint8Array([1, 9, 1, 0x78])
      stream.send(new Uint8Array([payload.length, ...payload]))
    })
    const err = await failure(collect(forwardGenerate(opener(client, node, INFER_PROTOCOL), request(), new AbortController().signal)))
    expect(err).toMatchObject({ code: 'SHOAL_ERR_PEER_UNAVAILABLE', phase: 'before-start' })
    expect((err.cause as ShoalError).code).toBe('SHOAL_ERR_INFER_UNKNOWN_KIND')
  })

  it('server: resets a stream whose first frame is oversized, answers a non-request frame with an error frame', async () => {
    const service = new SimulatedPeer()
    const node = await serve(service)
    // Oversized: a length prefix above the cap; the server must drop the stream, not buffer it.
    const big = await client.dialProtocol(node.getMultiaddrs(), INFER_PROTOCOL)
    const closed = new Promise<Error | undefined>(resolve => big.addEventListener('close', (evt) => resolve(evt.error), { once: true }))
    const prefix: number[] = []
    for (let n = MAX_FRAME_BYTES + 1; ; n >>>= 7) {
      if (n < 0x80) { prefix.push(n); break }
      prefix.push((n & 0x7f) | 0x80)
    }
    big.send(new Uint8Array(prefix))
    expect(await closed).toBeDefined()

    // A cancel as the first frame gets an error frame back.
    const s = await client.dialProtocol(node.getMultiaddrs(), INFER_PROTOCOL)
    const chunks: Uint8Array[] = []
    const ended = new Promise<void>(resolve => s.addEventListener('close', () => resolve(), { once: true }))
    s.addEventListener('message', (evt) => { chunks.push(evt.data.subarray()) })
    s.send(encodeFrame({ kind: 'cancel', requestId: 'x1' }))
    await s.close()
    await ended
    const { decodeFrames } = await import('../../daemon/routing/index.ts')
    const frames = decodeFrames(Uint8Array.from(chunks.flatMap(c => [...c])))
    expect(frames).toHaveLength(1)
    expect(frames[0]).toMatchObject({ kind: 'error', requestId: 'x1', error: { code: 'SHOAL_ERR_INFER_UNEXPECTED_FRAME' } })
    expect(service.calls).toHaveLength(0)
  })

  describe('routed service over the mesh', () => {
    const load = (inFlight: number): Candidate['load'] => ({ observedAt: Date.now(), queueDepth: 0, inFlight, slots: 4, tokensPerSecond: 100 })

    it('server dies before start: the request is retried on another replica, invisibly', async () => {
      const release = Promise.withResolvers<void>()
      const doomed = new SimulatedPeer({ holdBeforeStart: async () => await release.promise })
      const healthy = new SimulatedPeer()
      const a = await server(doomed)
      const b = await serve(healthy)
      const nodes = new Map([[a.peerId.toString(), a], [b.peerId.toString(), b]])
      const opens = new Map([...nodes].map(([id, n]) => [id, opener(client, n, INFER_PROTOCOL)]))
      const routed = createRoutedService({ random: () => 0 }, {
        // a looks idle, b busy: the first choice is a.
        candidates: () => [
          { peerId: a.peerId.toString(), local: false, admitted: true, alive: true, wholeModel: true, load: load(0) },
          { peerId: b.peerId.toString(), local: false, admitted: true, alive: true, wholeModel: true, load: load(3) },
        ],
        forward: (peerId, req, signal) => forwardGenerate(opens.get(peerId) as never, req, signal, { peerId }),
      })
      const req = request({ maxTokens: 10 })
      const run = collect(routed.generate(req, new AbortController().signal))
      await doomed.arrived(req.requestId)
      await a.stop() // the peer dies while the request waits in its queue
      const events = await run
      expect(events[0]).toMatchObject({ type: 'start', route: [b.peerId.toString()] })
      expect(tokenIds(events)).toEqual(SimulatedPeer.tokensFor(req, 10))
      expect(healthy.calls).toEqual([req.requestId])
      release.resolve()
    })

    it('client errors are not retried elsewhere, and keep the code (and so the status) they had (issue 13 #4)', async () => {
      // A 5 MB prompt cannot travel: 413 at the forwarding node, nothing dialed, no Retry-After.
      const holder = new SimulatedPeer()
      const spare = new SimulatedPeer()
      const a = await serve(holder)
      const b = await serve(spare)
      const opens = new Map([a, b].map(n => [n.peerId.toString(), opener(client, n, INFER_PROTOCOL)]))
      const routed = createRoutedService({ random: () => 0 }, {
        candidates: () => [
          { peerId: a.peerId.toString(), local: false, admitted: true, alive: true, wholeModel: true, load: load(0) },
          { peerId: b.peerId.toString(), local: false, admitted: true, alive: true, wholeModel: true, load: load(3) },
        ],
        forward: (peerId, req, signal) => forwardGenerate(opens.get(peerId) as never, req, signal, { peerId }),
      })
      const big = request({ prompt: { kind: 'text', text: 'x'.repeat(5 * 1024 * 1024) } })
      const tooBig = await failure(collect(routed.generate(big, new AbortController().signal)))
      expect(tooBig).toMatchObject({ code: 'SHOAL_ERR_CONTEXT_LENGTH', retryable: false })
      expect(httpStatusOf(tooBig).status).toBe(413)

      // A lone surrogate that reached a node anyway is a 400 from it, carried back as it was.
      const bad = request({ prompt: { kind: 'text', text: 'a\ud800b' } })
      const badErr = await failure(collect(routed.generate(bad, new AbortController().signal)))
      expect(badErr).toMatchObject({ code: 'SHOAL_ERR_BAD_REQUEST', retryable: false })
      expect(httpStatusOf(badErr).status).toBe(400)
      expect(holder.calls).toEqual([])
      expect(spare.calls).toEqual([])
    })

    it('server dies after start: a typed PEER_LOST error, no retry, no hang', async () => {
      const dying = new SimulatedPeer({ stallAfter: 3 })
      const spare = new SimulatedPeer()
      const a = await server(dying)
      const b = await serve(spare)
      const opens = new Map([a, b].map(n => [n.peerId.toString(), opener(client, n, INFER_PROTOCOL)]))
      const routed = createRoutedService({ random: () => 0 }, {
        candidates: () => [
          { peerId: a.peerId.toString(), local: false, admitted: true, alive: true, wholeModel: true, load: load(0) },
          { peerId: b.peerId.toString(), local: false, admitted: true, alive: true, wholeModel: true, load: load(3) },
        ],
        forward: (peerId, req, signal) => forwardGenerate(opens.get(peerId) as never, req, signal, { peerId }),
      })
      const req = request({ maxTokens: 50 })
      const events: GenerateEvent[] = []
      const err = await failure((async () => {
        for await (const ev of routed.generate(req, new AbortController().signal)) {
          events.push(ev)
          if (tokenIds(events).length === 3) await a.stop()
        }
      })())
      expect(err).toMatchObject({ code: 'SHOAL_ERR_PEER_LOST', phase: 'after-start', retryable: false, peerId: a.peerId.toString() })
      expect(tokenIds(events)).toEqual(SimulatedPeer.tokensFor(req, 3))
      expect(spare.calls).toEqual([])
      expect(routed.inFlight()).toEqual({})
    })
  })

  describe('over QUIC (the mesh\'s first transport)', () => {
    it('delivers every token in order and propagates cancel', async () => {
      const quicClient = await createTestNode('quic')
      started.push(quicClient)
      const full = new SimulatedPeer()
      const stalling = new SimulatedPeer({ stallAfter: 3 })
      const a = await server(full, 'quic')
      const b = await server(stalling, 'quic')
      started.push(a, b)
      const req = request({ maxTokens: 30 })
      const events = await collect(forwardGenerate(opener(quicClient, a, INFER_PROTOCOL), req, new AbortController().signal))
      expect(events[0]).toMatchObject({ type: 'start', route: [a.peerId.toString()] })
      expect(tokenIds(events)).toEqual(SimulatedPeer.tokensFor(req, 30))
      expect(events.at(-1)).toMatchObject({ type: 'end' })

      const req2 = request({ maxTokens: 30 })
      for await (const ev of forwardGenerate(opener(quicClient, b, INFER_PROTOCOL), req2, new AbortController().signal)) {
        if (ev.type === 'delta') break
      }
      await stalling.aborted(req2.requestId)
    })
  })
})

/**
 * A stage node: one StageEngine (this node's layers, shared by every request) behind the
 * /shoal/stage/2.0.0 links. As a middle or last stage it serves open / activation / cancel frames:
 * KV is keyed by request id; activations of one request run in order, different requests
 * interleave freely (while this stage steps request A, its neighbours step B and C); the last stage
 * samples and sends only the token id to the coordinator. As the coordinator it lets a chain token
 * source `watch` a request's token and error frames. State of a request is dropped on cancel
 * (which also means "finished"), on error, at its deadline, after an idle timeout, and when the
 * link to the neighbour it depends on goes down; nothing waits without a bound. With a batcher,
 * the steps of every request waiting for this stage (the coordinator's own stage-0 steps included)
 * share engine runs. Speculative decoding: an activation that starts before what a stage holds
 * first sets the request's KV back to its start (drafts the chain rejected), and the last stage
 * answers a verify activation with a verdict (accepted drafts, its own next token).
 */
import { createHash } from 'node:crypto'
import type { Hash } from 'node:crypto'
import { deserializeError, serializeError } from '../errors.ts'
import { createReceiptPart } from '../ledger/index.ts'
import type { Batcher } from '../batcher/index.ts'
import { createRng, nextPick } from '../engine/index.ts'
import type { Rng, StageEngine, StageStepInput, StepOutput, TokenPick } from '../engine/index.ts'
import type { SerializedError } from '../errors.ts'
import { StageConfigError, StageLostError, StageWireError } from './errors.ts'
import { createLinks } from './links.ts'
import type { LinkComponents, LinkOptions, Links } from './links.ts'
import type { OpenBody, StageFrame } from './wire.ts'
import { checkDrafts } from './verify.ts'
import { roundTripActivation } from './activations.ts'
import { MAX_TIMER_MS } from '../abort.ts'

export interface StageNodeInit extends LinkOptions {
  /** Started by the caller; the node never starts or stops it. With `rollback`, it serves speculative verifies. */
  engine: StageEngine & { rollback?: (seqId: string, length: number, signal?: AbortSignal) => Promise<void> }
  /** Over `engine`, started by the caller: when given, every step goes through it (shared runs). */
  batcher?: Batcher
  modelId: string
  manifestHash: string
  /** Silence after which a served request's state is dropped (default 60 s). */
  idleTimeoutMs?: number
  /** Signs this stage's receipt part when a request finishes; without it no part is sent. */
  signer?: { peerId: string, secretKey: Uint8Array }
  /** Why the upstream peer of an open frame may not have this stage work for it (certificate roles); answered as an error frame. */
  authorize?: (from: string) => Error | undefined
}

export interface StageNodeStats {
  /** Requests this node serves as a stage (KV held in the engine). */
  served: number
  /** Requests this node coordinates that wait for tokens. */
  watched: number
  streams: number
  /** Stage-wire frame bytes this node sent and received (activations, tokens, control). */
  bytesSent: number
  bytesReceived: number
}

/** Token and error frames of one coordinated request, plus losses of the peers it runs on. */
export interface TokenWatch {
  /** The next token or verdict frame (`accepted` set for a verdict); rejects with the request's typed error, or signal.reason. */
  next (signal: AbortSignal): Promise<{ position: number, tokenId: number, accepted?: number }>
  /** Signed receipt parts received; waits until `count` stages have answered or the signal fires. */
  parts (count: number, signal: AbortSignal): Promise<Array<Record<string, unknown>>>
  close (): void
}

export interface StageNode {
  readonly peerId: string
  readonly engine: StageEngine
  readonly modelId: string
  readonly manifestHash: string
  start (): Promise<void>
  stop (): Promise<void>
  send (peerId: string, frame: StageFrame, signal: AbortSignal): Promise<void>
  /**
   * One step of one sequence on this node's stage (through the batcher when there is one); logits
   * of the last position, or its picked token. `verify`: the positions are a token and its drafts
   * (scheduled as a decode), with logits of the last `logitsToKeep` rows.
   */
  step (seqId: string, input: StageStepInput, positions: number[], pick: TokenPick | undefined, signal: AbortSignal, verify?: { logitsToKeep: number }): Promise<StepOutput>
  /** The sequence is done here: its batcher company is not waited for and its KV is freed. */
  free (seqId: string): Promise<void>
  /** Sets a sequence's KV back to its first `length` positions (speculative drafts rejected). */
  rollback (seqId: string, length: number, signal: AbortSignal): Promise<void>
  /**
   * Sequences one engine run should take now so this node's requests move through their chain in
   * one wave per stage (⌈requests here / stages⌉): the batcher's cap, so batching never marches
   * every request through the chain in lockstep while the other stages idle.
   */
  waveCap (): number
  watch (requestId: string, peers: readonly string[]): TokenWatch
  stats (): StageNodeStats
  /**
   * Measured decode step time of this stage, ms: a moving average of single-position steps (the
   * coordinator's own and those served for chains, queueing in the batcher included); undefined
   * before the first. Gossiped in the capabilities so chains prefer fast holders.
   */
  stepMs (): number | undefined
}

interface Served {
  id: string
  open: OpenBody
  upstream: string
  next: string | undefined
  rng: Rng | undefined
  tail: Promise<void>
  ctl: AbortController
  timers: Array<ReturnType<typeof setTimeout>>
  idle: ReturnType<typeof setTimeout> | undefined
  /** What this stage received and produced for the request, for its signed receipt part. */
  received: Hash
  produced: Hash
  rowsIn: number
  rowsOut: number
  startedAt: number
  /** Positions this stage's KV holds for the request. */
  held: number
}

interface Watch {
  peers: Set<string>
  queue: Array<{ position: number, tokenId: number, accepted?: number } | Error>
  parts: Array<Record<string, unknown>>
  wake: (() => void) | undefined
}

/** Bytes of a tensor, for hashing without a copy. */
const bytesOf = (a: Float32Array): Uint8Array => new Uint8Array(a.buffer, a.byteOffset, a.byteLength)

const SEND_TIMEOUT_MS = 30_000
/** Weight of the newest decode step in the measured step time (about the last ten steps count). */
const STEP_EWMA = 0.2

export function createStageNode (init: StageNodeInit, components: LinkComponents): StageNode {
  const { engine } = init
  const stage = engine.stage
  const idleMs = init.idleTimeoutMs ?? 60_000
  const links: Links = createLinks(components, init)
  const served = new Map<string, Served>()
  const watches = new Map<string, Watch>()
  const self = components.peerId

  const sendSoon = (peerId: string, frame: StageFrame): void => {
    links.send(peerId, frame, AbortSignal.timeout(SEND_TIMEOUT_MS)).catch(() => {})
  }

  /** Moving average of decode step times (weight of the newest: STEP_EWMA). */
  let stepMs: number | undefined

  async function step (seqId: string, input: StageStepInput, positions: number[], pick: TokenPick | undefined, signal: AbortSignal, verify?: { logitsToKeep: number }): Promise<StepOutput> {
    const started = performance.now()
    const out = await runStep(seqId, input, positions, pick, signal, verify)
    if (positions.length === 1) {
      const ms = performance.now() - started
      stepMs = stepMs === undefined ? ms : stepMs + STEP_EWMA * (ms - stepMs)
    }
    return out
  }

  async function runStep (seqId: string, input: StageStepInput, positions: number[], pick: TokenPick | undefined, signal: AbortSignal, verify?: { logitsToKeep: number }): Promise<StepOutput> {
    const picking = pick === undefined ? {} : { pick }
    const batcher = init.batcher
    const logitsToKeep = verify?.logitsToKeep ?? 1
    if (batcher === undefined) return await engine.step(seqId, input, positions, { logitsToKeep, ...picking }, signal)
    // A verify (several positions) is a decode: it holds a live stream's next tokens.
    return await batcher.submit({ seqId, kind: positions.length > 1 && verify === undefined ? 'prefill' : 'decode', input, positions, logitsToKeep, ...picking }, signal)
  }

  async function rollback (seqId: string, length: number, signal: AbortSignal): Promise<void> {
    if (engine.rollback === undefined) throw new StageConfigError('this stage engine cannot roll a sequence back (no speculative decoding)')
    await engine.rollback(seqId, length, signal)
  }

  async function free (seqId: string): Promise<void> {
    init.batcher?.release(seqId)
    await engine.free(seqId)
  }

  function waveCap (): number {
    let stages = 1
    for (const s of served.values()) stages = Math.max(stages, s.open.chain.length)
    for (const w of watches.values()) stages = Math.max(stages, w.peers.size + 1)
    return Math.max(1, Math.ceil((served.size + watches.size) / stages))
  }

  /** Drops a served request: KV freed after its running step stops; cancel goes downstream. */
  function drop (s: Served, cancelDownstream: boolean): void {
    if (served.get(s.id) !== s) return
    served.delete(s.id)
    s.ctl.abort(new StageLostError('request dropped'))
    for (const t of s.timers) clearTimeout(t)
    clearTimeout(s.idle)
    void s.tail.finally(() => free(s.id).catch(() => {}))
    if (cancelDownstream && s.next !== undefined) sendSoon(s.next, { kind: 'cancel', requestId: s.id })
  }

  function fail (s: Served, err: unknown): void {
    if (served.get(s.id) !== s) return
    if (s.open.returnTo !== self) sendSoon(s.open.returnTo, { kind: 'error', requestId: s.id, error: errorBody(err) })
    drop(s, true)
  }

  function touch (s: Served): void {
    clearTimeout(s.idle)
    s.idle = setTimeout(() => fail(s, new StageLostError(`no frame for request ${s.id} in ${idleMs} ms`)), idleMs)
  }

  function checkOpen (o: OpenBody): void {
    const hop = o.chain[o.hop]!
    if (hop.peerId !== self) throw new StageConfigError(`open frame addressed to ${hop.peerId}, not this node`)
    if (o.modelId !== init.modelId || o.manifestHash !== init.manifestHash) throw new StageWireError('SHOAL_ERR_STAGE_MISMATCH', `this node serves ${init.modelId} (manifest ${init.manifestHash.slice(0, 12)}), not ${o.modelId} (manifest ${o.manifestHash.slice(0, 12)})`)
    if (hop.layers[0] !== stage.layers[0] || hop.layers[1] !== stage.layers[1]) throw new StageWireError('SHOAL_ERR_STAGE_MISMATCH', `this node holds layers ${stage.layers.join('-')}, not ${hop.layers.join('-')}`)
    if (stage.hasEmbedding) throw new StageWireError('SHOAL_ERR_STAGE_MISMATCH', 'the embedding stage takes no activations')
    if ((o.hop === o.chain.length - 1) !== stage.hasHead) throw new StageWireError('SHOAL_ERR_STAGE_MISMATCH', 'only the stage with the head may end a chain')
  }

  function onOpen (f: Extract<StageFrame, { kind: 'open' }>, from: string): void {
    const o = f.open
    try {
      if (served.has(f.requestId)) throw new StageWireError('SHOAL_ERR_STAGE_MALFORMED', `request ${f.requestId} is already open here`)
      const refused = init.authorize?.(from)
      if (refused !== undefined) throw refused
      checkOpen(o)
    } catch (err) {
      sendSoon(from, { kind: 'error', requestId: f.requestId, error: serializeError(err) })
      return
    }
    const last = o.hop === o.chain.length - 1
    const s: Served = {
      id: f.requestId,
      open: o,
      upstream: from,
      next: last ? undefined : o.chain[o.hop + 1]!.peerId,
      rng: undefined,
      tail: Promise.resolve(),
      ctl: new AbortController(),
      timers: [],
      idle: undefined,
      received: createHash('sha256'),
      produced: createHash('sha256'),
      rowsIn: 0,
      rowsOut: 0,
      startedAt: Date.now(),
      held: 0,
    }
    if (last) {
      s.rng = createRng(o.sampling.seed)
      for (let i = 0; i < o.rngSkip; i++) s.rng()
    }
    served.set(s.id, s)
    const untilDeadline = o.deadline - Date.now()
    s.timers.push(setTimeout(() => fail(s, new StageLostError('the request deadline passed at a stage')), Math.max(0, Math.min(untilDeadline, MAX_TIMER_MS))))
    touch(s)
    // Open downstream right away: frames on one link keep their order, so it precedes our output.
    if (s.next !== undefined) sendSoon(s.next, { kind: 'open', requestId: s.id, open: { ...o, hop: o.hop + 1 } })
    s.tail = engine.open(s.id, s.ctl.signal).then(() => {}, (err: unknown) => fail(s, err))
  }

  function onActivation (f: Extract<StageFrame, { kind: 'activation' }>, from: string): void {
    const s = served.get(f.requestId)
    if (s === undefined) {
      sendSoon(from, { kind: 'error', requestId: f.requestId, error: serializeError(new StageWireError('SHOAL_ERR_STAGE_UNKNOWN_REQUEST', `no open request ${f.requestId} on this stage`)) })
      return
    }
    if (f.width !== stage.hiddenSize) {
      fail(s, new StageWireError('SHOAL_ERR_STAGE_MISMATCH', `activation width ${f.width}, this stage's hidden size is ${stage.hiddenSize}`))
      return
    }
    touch(s)
    s.received.update(bytesOf(f.data))
    s.rowsIn += f.rows
    const positions = Array.from({ length: f.rows }, (_, i) => f.start + i)
    s.tail = s.tail.then(async () => {
      if (served.get(s.id) !== s) return
      if (f.start > s.held) throw new StageWireError('SHOAL_ERR_STAGE_MALFORMED', `activation starts at ${f.start}; this stage holds ${s.held} positions`)
      // Drafts the chain rejected: the KV goes back to where this activation starts.
      if (f.start < s.held) await rollback(s.id, f.start, s.ctl.signal)
      s.held = f.start
      const verify = f.drafts
      // The last stage picks the token in its engine worker (the draw from this sequence's seeded
      // generator made here first), so only the id comes back from the worker; a verify needs the
      // logits of every row instead.
      const pick = s.next === undefined && f.final && verify === undefined ? nextPick(s.open.sampling, s.rng!) : undefined
      const out = await step(s.id, { hidden: f.data }, positions, pick, s.ctl.signal, verify === undefined ? undefined : { logitsToKeep: s.next === undefined ? f.rows : 1 })
      s.held = f.start + f.rows
      if (s.next !== undefined) {
        if (out.kind !== 'hidden') throw new StageConfigError('a middle stage must return hidden states')
        // The chain's encoding (its open frame's); the part hashes what the next stage receives.
        const encoding = s.open.activations
        s.produced.update(bytesOf(encoding === undefined ? out.data : roundTripActivation(encoding, out.data, out.count, out.hidden)))
        s.rowsOut += out.count
        await links.send(s.next, { kind: 'activation', requestId: s.id, start: f.start, final: f.final, rows: out.count, width: out.hidden, data: out.data, ...(verify === undefined ? {} : { drafts: verify }), ...(encoding === undefined ? {} : { encoding }) }, s.ctl.signal)
      } else if (verify !== undefined) {
        if (out.kind !== 'logits' || out.count !== f.rows) throw new StageConfigError('the last stage must return logits for every verified row')
        // Greedy by id, or speculative sampling with the drafts as point masses (verify.ts).
        const { accepted, tokenId } = checkDrafts(out.data, out.vocab, verify, s.open.sampling, s.rng!)
        const position = f.start + accepted + 1
        s.produced.update(new Uint8Array(Uint32Array.of(position, tokenId).buffer))
        s.rowsOut += accepted + 1
        await links.send(s.open.returnTo, { kind: 'verdict', requestId: s.id, position, accepted, tokenId }, s.ctl.signal)
      } else if (f.final) {
        if (out.kind !== 'token') throw new StageConfigError('the last stage must return a token')
        const tokenId = out.id
        s.produced.update(new Uint8Array(Uint32Array.of(f.start + f.rows, tokenId).buffer))
        s.rowsOut++
        await links.send(s.open.returnTo, { kind: 'token', requestId: s.id, position: f.start + f.rows, tokenId }, s.ctl.signal)
      }
    }).catch((err: unknown) => { if (!s.ctl.signal.aborted) fail(s, err) })
  }

  function onFrame (f: StageFrame, from: string): void {
    const w = watches.get(f.requestId)
    if (w !== undefined && (f.kind === 'token' || f.kind === 'verdict' || f.kind === 'error' || f.kind === 'part')) {
      if (f.kind === 'part') {
        if (w.parts.length < w.peers.size) w.parts.push(f.part)
      } else {
        w.queue.push(f.kind === 'token' ? { position: f.position, tokenId: f.tokenId } : f.kind === 'verdict' ? { position: f.position, tokenId: f.tokenId, accepted: f.accepted } : remoteError(f.error))
      }
      const wake = w.wake
      w.wake = undefined
      wake?.()
      return
    }
    switch (f.kind) {
      case 'open': onOpen(f, from); return
      case 'activation': onActivation(f, from); return
      case 'cancel': {
        const s = served.get(f.requestId)
        if (s !== undefined) drop(s, true)
        return
      }
      case 'finish': {
        const s = served.get(f.requestId)
        if (s !== undefined) void finish(s)
        return
      }
      case 'part': return // for a request no longer watched
      case 'error': {
        // From downstream: pass it to the coordinator and drop our part.
        const s = served.get(f.requestId)
        if (s !== undefined) fail(s, remoteError(f.error))
        return
      }
      case 'token':
      case 'verdict': return // for a request no longer watched
    }
  }

  /** The request completed: sign this stage's part for the coordinator, then pass finish on and drop. */
  async function finish (s: Served): Promise<void> {
    // Steps still running for the request finish first, so the hashes cover everything.
    await s.tail.catch(() => {})
    if (served.get(s.id) !== s) return
    // Always answer, with {} when this stage signs nothing, so the coordinator need not wait it out.
    let part: Record<string, unknown> = {}
    const signer = init.signer
    if (signer !== undefined) {
      try {
        part = createReceiptPart({
          requestId: s.open.receiptId ?? s.id,
          peerId: signer.peerId,
          model: s.open.modelId,
          layers: [stage.layers[0], stage.layers[1]],
          inputHash: s.received.digest('hex'),
          outputHash: s.produced.digest('hex'),
          tokens: { input: s.rowsIn, output: s.rowsOut },
          timing: { startedAt: s.startedAt, durationMs: Date.now() - s.startedAt },
        }, signer.secretKey) as unknown as Record<string, unknown>
      } catch {
        // A part that cannot be made is left out; the coordinator's receipt still names this stage.
      }
    }
    sendSoon(s.open.returnTo, { kind: 'part', requestId: s.id, part })
    if (s.next !== undefined) sendSoon(s.next, { kind: 'finish', requestId: s.id })
    drop(s, false)
  }

  function onLinkDown (peerId: string): void {
    for (const s of [...served.values()]) {
      if (s.upstream === peerId || s.next === peerId || s.open.returnTo === peerId) fail(s, new StageLostError(`lost the link to stage peer ${peerId}`, peerId))
    }
    for (const w of watches.values()) {
      if (!w.peers.has(peerId)) continue
      w.queue.push(new StageLostError(`lost the link to stage peer ${peerId}`, peerId))
      const wake = w.wake
      w.wake = undefined
      wake?.()
    }
  }

  links.onFrame(onFrame)
  links.onLinkDown(onLinkDown)

  return {
    peerId: self,
    engine,
    modelId: init.modelId,
    manifestHash: init.manifestHash,
    start: async () => { await links.start() },
    async stop () {
      for (const s of [...served.values()]) drop(s, false)
      await links.stop()
    },
    send: async (peerId, frame, signal) => { await links.send(peerId, frame, signal) },
    step,
    free,
    rollback,
    waveCap,
    watch (requestId, peers) {
      if (watches.has(requestId)) throw new StageWireError('SHOAL_ERR_STAGE_MALFORMED', `request ${requestId} is already watched`)
      const w: Watch = { peers: new Set(peers), queue: [], parts: [], wake: undefined }
      watches.set(requestId, w)
      return {
        async next (signal) {
          for (;;) {
            const item = w.queue.shift()
            if (item instanceof Error) throw item
            if (item !== undefined) return item
            signal.throwIfAborted()
            await new Promise<void>((resolve, reject) => {
              const onAbort = (): void => { w.wake = undefined; reject(signal.reason) }
              signal.addEventListener('abort', onAbort, { once: true })
              w.wake = () => { signal.removeEventListener('abort', onAbort); resolve() }
            })
          }
        },
        async parts (count, signal) {
          while (w.parts.length < count && !signal.aborted) {
            await new Promise<void>((resolve) => {
              const onAbort = (): void => { w.wake = undefined; resolve() }
              signal.addEventListener('abort', onAbort, { once: true })
              w.wake = () => { signal.removeEventListener('abort', onAbort); resolve() }
            })
          }
          return w.parts.filter(p => Object.keys(p).length > 0)
        },
        close () {
          if (watches.get(requestId) === w) watches.delete(requestId)
        },
      }
    },
    stats: () => { const b = links.bytes(); return { served: served.size, watched: watches.size, streams: links.streams(), bytesSent: b.sent, bytesReceived: b.received } },
    stepMs: () => stepMs,
  }
}

/** An error for an error frame: the code, plus the lost peer's id when there is one. */
function errorBody (err: unknown): SerializedError & { peerId?: string } {
  const peerId = err instanceof StageLostError ? err.peerId : undefined
  return peerId === undefined ? serializeError(err) : { ...serializeError(err), peerId }
}

/** An error frame from a peer, as an Error with the peer's name and code. */
function remoteError (e: SerializedError & { peerId?: string }): Error {
  if (e.code === 'SHOAL_ERR_PEER_LOST') return new StageLostError(e.message, e.peerId)
  return deserializeError(e)
}

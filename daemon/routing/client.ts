/**
 * The forwarding client: runs one GenerateRequest on a peer over /shoal/infer/1.0.0 and yields
 * its events as they arrive. Every error it throws is a ForwardError whose `phase` says whether
 * anything reached the caller (`before-start`: another replica may take the request, see
 * `retryable`; `after-start`: the stream ends with the error). It never waits without a bound:
 * the caller's signal, the request deadline, and an idle timeout on every read — cut to
 * PEER_LOST_IDLE_MS once the mesh says it lost contact with the peer, so a node that died without
 * closing anything (SIGKILL, a pulled cable: QUIC sees no close) costs seconds, not the idle bound.
 */
import type { Stream } from '@libp2p/interface'
import type { GenerateEvent, GenerateRequest } from '../service.ts'
import {
  DeadlineExceededError, ForwardAbortedError, ForwardError, InferWireError, PeerLostError,
  PeerUnavailableError, RemoteError, RequestTooLargeError,
} from './errors.ts'
import type { ForwardPhase } from './errors.ts'
import { createFrameReader } from './frame-stream.ts'
import { encodeFrame, MAX_FRAME_BYTES } from './wire.ts'
import { MAX_TIMER_MS, raceAbort } from '../abort.ts'

/** Opens a stream for /shoal/infer/1.0.0 to one peer (the mesh's `openStream(peerId, protocol, signal)`). */
export type StreamOpener = (signal: AbortSignal) => Promise<Stream>

export interface ForwardOptions {
  /** Named in errors. */
  peerId?: string
  /** Longest wait for the first frame (queueing + prefill on the peer). */
  firstFrameTimeoutMs?: number
  /** Longest silence between frames after the first. */
  idleTimeoutMs?: number
  /**
   * Fires when the mesh stops hearing from the peer (it turned suspect or left). From then on a
   * silence of PEER_LOST_IDLE_MS ends the forward: a peer still streaming is left alone.
   */
  peerLost?: AbortSignal
  maxFrameBytes?: number
}

export const DEFAULT_FIRST_FRAME_TIMEOUT_MS = 60_000
export const DEFAULT_IDLE_TIMEOUT_MS = 30_000
/** Silence that ends a forward once the mesh has lost contact with its peer. */
export const PEER_LOST_IDLE_MS = 1_000

/** Why the forwarding controller aborted; the error thrown follows from it. */
type Stop = { why: 'caller', reason: unknown } | { why: 'deadline' } | { why: 'idle', ms: number, lost: boolean }
const isStop = (v: unknown): v is Stop => typeof v === 'object' && v !== null && 'why' in v

export async function * forwardGenerate (open: StreamOpener, request: GenerateRequest, signal: AbortSignal, options: ForwardOptions = {}): AsyncGenerator<GenerateEvent, void, undefined> {
  const peer = options.peerId
  const maxFrameBytes = options.maxFrameBytes ?? MAX_FRAME_BYTES
  const where = peer === undefined ? 'peer' : `peer ${peer}`
  let phase: ForwardPhase = 'before-start'
  if (signal.aborted) throw new ForwardAbortedError(phase, peer, { cause: signal.reason })
  if (Date.now() >= request.deadline) throw new DeadlineExceededError('the deadline passed before forwarding', phase, peer)

  // Encoded before dialing: a request no frame can carry (a prompt of megabytes) is the client's
  // problem, and would be on every replica — a 413, never a retryable "peer unavailable".
  let requestBytes: Uint8Array
  try {
    // Each UTF-16 unit is at least one byte: a prompt this long cannot fit, and is not encoded to find out.
    const chars = promptLength(request)
    if (chars > maxFrameBytes) throw new InferWireError('SHOAL_ERR_INFER_TOO_LARGE', `a prompt of ${chars} characters exceeds the ${maxFrameBytes}-byte frame cap`)
    requestBytes = encodeFrame({ kind: 'request', requestId: request.requestId, request }, maxFrameBytes)
  } catch (err) {
    if ((err as { code?: unknown }).code !== 'SHOAL_ERR_INFER_TOO_LARGE') throw err
    throw new RequestTooLargeError(`the request is too large to run on another node (${(err as Error).message}); shorten the prompt`, peer)
  }

  const ctl = new AbortController()
  const onCallerAbort = (): void => ctl.abort({ why: 'caller', reason: signal.reason } satisfies Stop)
  signal.addEventListener('abort', onCallerAbort, { once: true })
  const untilDeadline = request.deadline - Date.now()
  const deadlineTimer = untilDeadline <= MAX_TIMER_MS ? setTimeout(() => ctl.abort({ why: 'deadline' } satisfies Stop), untilDeadline) : undefined

  /** The wait in progress: its timer, re-armed shorter when the peer is lost meanwhile. */
  let waiting: { timer: ReturnType<typeof setTimeout>, since: number, ms: number } | undefined
  let lost = options.peerLost?.aborted === true
  const idleStop = (ms: number): Stop => ({ why: 'idle', ms, lost })
  const onLost = (): void => {
    lost = true
    const w = waiting
    if (w === undefined || w.ms <= PEER_LOST_IDLE_MS) return
    clearTimeout(w.timer)
    w.ms = PEER_LOST_IDLE_MS
    w.timer = setTimeout(() => ctl.abort(idleStop(PEER_LOST_IDLE_MS)), Math.max(0, w.since + PEER_LOST_IDLE_MS - Date.now()))
  }
  options.peerLost?.addEventListener('abort', onLost, { once: true })

  /** Runs `p` with an idle timer of `ms` armed only while waiting on the peer. */
  const bounded = async <T>(p: () => Promise<T>, ms: number): Promise<T> => {
    const bound = lost ? Math.min(ms, PEER_LOST_IDLE_MS) : ms
    const w = { timer: setTimeout(() => ctl.abort(idleStop(bound)), bound), since: Date.now(), ms: bound }
    waiting = w
    try {
      return await raceAbort(p(), ctl.signal)
    } finally {
      clearTimeout(w.timer)
      if (waiting === w) waiting = undefined
    }
  }

  const classify = (err: unknown): ForwardError => {
    if (ctl.signal.aborted && isStop(ctl.signal.reason)) {
      const stop = ctl.signal.reason
      if (stop.why === 'caller') return new ForwardAbortedError(phase, peer, { cause: stop.reason })
      if (stop.why === 'deadline') return new DeadlineExceededError(`the deadline passed while waiting on ${where}`, phase, peer)
      const msg = `${where} sent nothing for ${stop.ms} ms${stop.lost ? ' after the mesh lost contact with it' : ''}`
      return phase === 'before-start' ? new PeerUnavailableError(msg, peer) : new PeerLostError(msg, peer)
    }
    if (err instanceof ForwardError) return err
    const detail = err instanceof Error ? err.message : String(err)
    return phase === 'before-start'
      ? new PeerUnavailableError(`${where} failed before start: ${detail}`, peer, { cause: err })
      : new PeerLostError(`${where} failed mid-stream: ${detail}`, peer, { cause: err })
  }

  const firstMs = options.firstFrameTimeoutMs ?? DEFAULT_FIRST_FRAME_TIMEOUT_MS
  const idleMs = options.idleTimeoutMs ?? DEFAULT_IDLE_TIMEOUT_MS
  const unexpected = (what: string): InferWireError => new InferWireError('SHOAL_ERR_INFER_UNEXPECTED_FRAME', `${where} sent ${what}`)
  let stream: Stream | undefined
  let reader: ReturnType<typeof createFrameReader> | undefined
  let settled = false // the peer sent end or error: nothing to cancel
  try {
    const opened = open(ctl.signal)
    // An opener that ignores the signal must not leak the stream it opens late.
    opened.then(s => { if (ctl.signal.aborted && stream === undefined) s.abort(new Error('forward aborted')) }, () => {})
    stream = await bounded(async () => await opened, firstMs)
    reader = createFrameReader(stream, maxFrameBytes)
    const s = stream
    await bounded(async () => { if (!s.send(requestBytes)) await s.onDrain({ signal: ctl.signal }) }, firstMs)
    while (true) {
      const r = reader
      const frame = await bounded(async () => await r.next(ctl.signal), phase === 'before-start' ? firstMs : idleMs)
      if (frame === null) throw new Error('the stream closed before the end frame')
      if (frame.requestId !== request.requestId) throw unexpected(`a frame for request ${frame.requestId}`)
      switch (frame.kind) {
        case 'start':
          if (phase !== 'before-start') throw unexpected('a second start frame')
          phase = 'after-start'
          yield frame.event
          break
        case 'delta':
          if (phase === 'before-start') throw unexpected('a delta before start')
          yield frame.event
          break
        case 'end':
          if (phase === 'before-start') throw unexpected('end before start')
          settled = true
          yield frame.event
          return
        case 'error':
          settled = true
          throw new RemoteError(frame.error, phase, peer)
        default:
          throw unexpected(`a ${frame.kind} frame`)
      }
    }
  } catch (err) {
    throw classify(err)
  } finally {
    clearTimeout(deadlineTimer)
    signal.removeEventListener('abort', onCallerAbort)
    options.peerLost?.removeEventListener('abort', onLost)
    reader?.dispose()
    if (stream !== undefined) release(stream, settled ? undefined : request.requestId, maxFrameBytes)
    ctl.abort({ why: 'caller', reason: 'done' } satisfies Stop)
  }
}

/** UTF-16 units of the request's text (a lower bound on its encoded bytes). */
function promptLength (request: GenerateRequest): number {
  const p = request.prompt
  if (p.kind === 'text') return p.text.length
  if (p.kind === 'tokens') return p.ids.length
  let n = 0
  for (const m of p.messages) n += m.content.length + m.role.length + (m.name?.length ?? 0)
  return n
}

/** Closes our side; first tells the peer to stop when it has not finished. Never waits long. */
function release (stream: Stream, cancelId: string | undefined, maxFrameBytes: number): void {
  if (stream.status !== 'open') return
  try {
    if (cancelId !== undefined && stream.writeStatus === 'writable') stream.send(encodeFrame({ kind: 'cancel', requestId: cancelId }, maxFrameBytes))
  } catch { /* the stream broke: the peer sees the reset instead */ }
  stream.close({ signal: AbortSignal.timeout(5_000) }).catch((err: Error) => { stream.abort(err) })
}

/**
 * The forwarding server: serves one /shoal/infer/1.0.0 stream by running the request on a local
 * InferenceService. The service's AbortSignal fires on a cancel frame, when the client closes or
 * resets the stream, and at the request's deadline. The node's peer id is appended to the route
 * in the start event. The handler never throws and never outlives the stream.
 */
import type { Stream } from '@libp2p/interface'
import { serializeError, ShoalError } from '../errors.ts'
import type { SerializedError } from '../errors.ts'
import type { GenerateEvent, InferenceService } from '../service.ts'
import { findLoneSurrogate } from '../text/index.ts'
import { InferWireError } from './errors.ts'
import { createFrameReader, writeFrame } from './frame-stream.ts'
import { MAX_FRAME_BYTES } from './wire.ts'
import type { InferFrame } from './wire.ts'
import { MAX_TIMER_MS, raceAbort } from '../abort.ts'

export interface InferHandlerOptions {
  /** This node's peer id, appended to the route. */
  localPeerId: string
  /** Longest wait for the request frame after the stream opens. */
  requestTimeoutMs?: number
  maxFrameBytes?: number
}

export const DEFAULT_REQUEST_TIMEOUT_MS = 10_000

/** Why generation stopped early; decides whether an error frame is still worth sending. */
type Stop = { why: 'cancelled' | 'gone' | 'done' } | { why: 'deadline' } | { why: 'protocol', error: SerializedError }
const isStop = (v: unknown): v is Stop => typeof v === 'object' && v !== null && 'why' in v

/** Appends `peerId` to a start event's route (once). */
export function withRouteHop (event: Extract<GenerateEvent, { type: 'start' }>, peerId: string): Extract<GenerateEvent, { type: 'start' }> {
  // A service that already names this node (a local engine, or a chain it coordinates) is not
  // given it twice: the route lists executing nodes, once each, in order.
  return event.route.includes(peerId) ? event : { ...event, route: [...event.route, peerId] }
}

function frameOf (requestId: string, ev: GenerateEvent): InferFrame {
  switch (ev.type) {
    case 'start': return { kind: 'start', requestId, event: ev }
    case 'delta': return { kind: 'delta', requestId, event: ev }
    case 'end': return { kind: 'end', requestId, event: ev }
  }
}

export async function handleInferStream (stream: Stream, service: InferenceService, options: InferHandlerOptions): Promise<void> {
  const maxFrameBytes = options.maxFrameBytes ?? MAX_FRAME_BYTES
  const reader = createFrameReader(stream, maxFrameBytes)
  const ctl = new AbortController()
  let deadlineTimer: ReturnType<typeof setTimeout> | undefined
  let requestId: string | undefined
  const sendError = async (error: SerializedError): Promise<void> => {
    if (requestId === undefined || stream.writeStatus !== 'writable') return
    await writeFrame(stream, { kind: 'error', requestId, error }, AbortSignal.timeout(5_000), maxFrameBytes)
  }
  try {
    const first = await reader.next(AbortSignal.timeout(options.requestTimeoutMs ?? DEFAULT_REQUEST_TIMEOUT_MS))
    if (first === null) return
    requestId = first.requestId
    if (first.kind !== 'request') {
      await sendError(serializeError(new InferWireError('SHOAL_ERR_INFER_UNEXPECTED_FRAME', `expected a request frame, got ${first.kind}`)))
      return
    }
    const request = first.request
    // The ingress refuses these already; a peer that did not is answered the same way, before
    // anything is generated whose receipt could not be hashed.
    const illFormed = findLoneSurrogate(request.prompt) ?? findLoneSurrogate(request.stop)
    if (illFormed !== undefined) {
      await sendError(serializeError(new ShoalError('SHOAL_ERR_BAD_REQUEST', 'the request holds a lone UTF-16 surrogate (not valid Unicode text)')))
      return
    }
    const untilDeadline = request.deadline - Date.now()
    if (untilDeadline <= 0) {
      await sendError(serializeError(new ShoalError('SHOAL_ERR_DEADLINE', 'the deadline passed before the request arrived')))
      return
    }
    if (untilDeadline <= MAX_TIMER_MS) deadlineTimer = setTimeout(() => ctl.abort({ why: 'deadline' } satisfies Stop), untilDeadline)
    void watchClient(reader, request.requestId, ctl)

    const events = service.generate(request, ctl.signal)[Symbol.asyncIterator]()
    try {
      while (true) {
        const r = await raceAbort(events.next(), ctl.signal)
        if (r.done === true) throw new ShoalError('SHOAL_ERR_INTERNAL', 'the service ended without an end event')
        const ev = r.value.type === 'start' ? withRouteHop(r.value, options.localPeerId) : r.value
        await writeFrame(stream, frameOf(request.requestId, ev), ctl.signal, maxFrameBytes)
        if (ev.type === 'end') {
          // Let the service's generator finish (its finally blocks free slots and meters).
          await events.return?.().catch(() => {})
          return
        }
      }
    } catch (err) {
      // Do not wait for a service that ignores its signal: ask it to stop and move on.
      events.return?.().catch(() => {})
      throw err
    }
  } catch (err) {
    const stop = ctl.signal.aborted && isStop(ctl.signal.reason) ? ctl.signal.reason : undefined
    if (stop?.why === 'cancelled' || stop?.why === 'gone') return
    if (stop?.why === 'deadline') {
      await sendError(serializeError(new ShoalError('SHOAL_ERR_DEADLINE', 'the deadline passed during generation'))).catch(() => {})
    } else if (stop?.why === 'protocol') {
      await sendError(stop.error).catch(() => {})
    } else if (requestId !== undefined) {
      await sendError(serializeError(err)).catch(() => {})
    } else {
      // No request id to answer to (bad first frame, or none in time): reset.
      stream.abort(err instanceof Error ? err : new Error(String(err)))
    }
  } finally {
    clearTimeout(deadlineTimer)
    if (!ctl.signal.aborted) ctl.abort({ why: 'done' } satisfies Stop)
    reader.dispose()
    if (stream.status === 'open') {
      await stream.close({ signal: AbortSignal.timeout(5_000) }).catch((err: Error) => { stream.abort(err) })
    }
  }
}

/** Reads the client's side during generation: a cancel frame, EOF or a reset stops it. */
async function watchClient (reader: ReturnType<typeof createFrameReader>, requestId: string, ctl: AbortController): Promise<void> {
  try {
    const f = await reader.next(ctl.signal)
    if (ctl.signal.aborted) return
    if (f === null || (f.kind === 'cancel' && f.requestId === requestId)) {
      ctl.abort({ why: f === null ? 'gone' : 'cancelled' } satisfies Stop)
    } else {
      const error = serializeError(new InferWireError('SHOAL_ERR_INFER_UNEXPECTED_FRAME', `unexpected ${f.kind} frame during generation`))
      ctl.abort({ why: 'protocol', error } satisfies Stop)
    }
  } catch (err) {
    if (ctl.signal.aborted) return
    const code = (err as { code?: unknown } | null)?.code
    if (typeof code === 'string' && code.startsWith('SHOAL_ERR_INFER_')) ctl.abort({ why: 'protocol', error: serializeError(err) } satisfies Stop)
    else ctl.abort({ why: 'gone' } satisfies Stop)
  }
}

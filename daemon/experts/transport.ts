/**
 * /shoal/experts/2.0.0 over libp2p streams. Holder side (serveExperts): every incoming stream's
 * frames are answered in arrival order by the holder. Stage side (createExpertLinks): one
 * long-lived stream per holder, opened on first use; answers are matched to their compute frames
 * by step id, so several steps may be in flight on one stream. A stream that closes or resets
 * fails every step waiting on it with SHOAL_ERR_PEER_LOST, which runExpertStep turns into a
 * fail-over to the expert's other copies.
 */
import type { Connection, Stream, StreamMessageEvent } from '@libp2p/interface'
import { Uint8ArrayList } from 'uint8arraylist'
import { ShoalError } from '../errors.ts'
import { ExpertWireError } from './errors.ts'
import type { ExpertHolder } from './holder.ts'
import type { ExpertLink } from './step.ts'
import { EXPERTS_PROTOCOL, MAX_FRAME_BYTES, peekStep } from './wire.ts'

export interface ExpertTransportComponents {
  /** Registers the protocol handler (the mesh's admission-enforcing `handle`). */
  handle (protocol: string, handler: (stream: Stream, connection: Connection) => void | Promise<void>): Promise<void>
  unhandle? (protocol: string): Promise<void>
  /** Opens a stream to a peer (the mesh's `openStream`). */
  openStream (peerId: string, protocol: string, signal: AbortSignal): Promise<Stream>
}

const MAX_VARINT_BYTES = 5

function lengthPrefixed (payload: Uint8Array): Uint8ArrayList {
  const prefix: number[] = []
  let n = payload.length
  while (n >= 0x80) { prefix.push((n % 128) | 0x80); n = Math.floor(n / 128) }
  prefix.push(n)
  return new Uint8ArrayList(Uint8Array.from(prefix), payload)
}

/** Splits complete varint-length-prefixed payloads off `buf`; throws on a frame over the cap. */
function splitFrames (buf: Uint8ArrayList, maxFrameBytes: number, onPayload: (p: Uint8Array) => void): void {
  while (buf.byteLength > 0) {
    let len = 0
    let scale = 1
    let i = 0
    for (; i < buf.byteLength; i++) {
      if (i >= MAX_VARINT_BYTES) throw new ExpertWireError('SHOAL_ERR_EXPERTS_TOO_LARGE', 'frame length prefix is too long')
      const b = buf.get(i)
      len += (b & 0x7f) * scale
      if ((b & 0x80) === 0) break
      scale *= 128
    }
    if (i === buf.byteLength) return
    if (len > maxFrameBytes) throw new ExpertWireError('SHOAL_ERR_EXPERTS_TOO_LARGE', `incoming frame of ${len} bytes exceeds the ${maxFrameBytes}-byte cap`)
    if (buf.byteLength < i + 1 + len) return
    const payload = buf.subarray(i + 1, i + 1 + len)
    buf.consume(i + 1 + len)
    onPayload(payload)
  }
}

async function send (stream: Stream, payload: Uint8Array, signal: AbortSignal): Promise<void> {
  if (!stream.send(lengthPrefixed(payload))) await stream.onDrain({ signal: AbortSignal.any([signal, AbortSignal.timeout(30_000)]) })
}

/** Serves `holder` on /shoal/experts/2.0.0 until stop(). */
export async function serveExperts (holder: ExpertHolder, components: ExpertTransportComponents, maxFrameBytes: number = MAX_FRAME_BYTES): Promise<{ stop: () => Promise<void> }> {
  const streams = new Set<Stream>()
  await components.handle(EXPERTS_PROTOCOL, (stream) => {
    streams.add(stream)
    const buf = new Uint8ArrayList()
    let chain = Promise.resolve()
    const stopping = new AbortController()
    stream.addEventListener('message', (evt: StreamMessageEvent) => {
      buf.append(evt.data)
      try {
        splitFrames(buf, maxFrameBytes, (payload) => {
          chain = chain.then(async () => {
            const answer = await holder.handle(payload)
            if (stream.writeStatus === 'writable') await send(stream, answer, stopping.signal)
          }).catch(() => { /* the stream broke: the stage sees that */ })
        })
      } catch (err) {
        stream.abort(err as Error)
      }
    })
    stream.addEventListener('close', () => { stopping.abort(); streams.delete(stream) }, { once: true })
  })
  return {
    async stop () {
      await components.unhandle?.(EXPERTS_PROTOCOL).catch(() => {})
      for (const s of streams) s.abort(new Error('holder stopping'))
      streams.clear()
    },
  }
}

interface Pending { resolve: (p: Uint8Array) => void, reject: (e: unknown) => void }
interface Link { stream: Stream, pending: Map<number, Pending> }

const lost = (peerId: string, why: string, cause?: unknown): ShoalError =>
  new ShoalError('SHOAL_ERR_PEER_LOST', `expert holder ${peerId}: ${why}`, cause === undefined ? undefined : { cause })

/** The stage's links to its holders. */
export function createExpertLinks (components: ExpertTransportComponents, options: { maxFrameBytes?: number, openTimeoutMs?: number } = {}): { link: ExpertLink, stop: () => void, streams: () => number } {
  const maxFrameBytes = options.maxFrameBytes ?? MAX_FRAME_BYTES
  const links = new Map<string, Link>()
  const opening = new Map<string, Promise<Link>>()

  function attach (peerId: string, stream: Stream): Link {
    const link: Link = { stream, pending: new Map() }
    const buf = new Uint8ArrayList()
    const fail = (err: unknown): void => {
      if (links.get(peerId) === link) links.delete(peerId)
      for (const p of link.pending.values()) p.reject(err)
      link.pending.clear()
    }
    stream.addEventListener('message', (evt: StreamMessageEvent) => {
      buf.append(evt.data)
      try {
        splitFrames(buf, maxFrameBytes, (payload) => {
          const step = peekStep(payload)
          const p = step === undefined ? undefined : link.pending.get(step)
          if (p === undefined) return // an answer nobody waits for (its step was aborted)
          link.pending.delete(step!)
          p.resolve(payload)
        })
      } catch (err) {
        stream.abort(err as Error)
        fail(err)
      }
    })
    stream.addEventListener('close', (evt) => { fail(lost(peerId, 'stream closed', (evt as { error?: unknown }).error)) }, { once: true })
    links.set(peerId, link)
    return link
  }

  async function linkTo (peerId: string, signal: AbortSignal): Promise<Link> {
    const have = links.get(peerId)
    if (have !== undefined && have.stream.status === 'open') return have
    let p = opening.get(peerId)
    if (p === undefined) {
      const s = AbortSignal.any([signal, AbortSignal.timeout(options.openTimeoutMs ?? 10_000)])
      p = components.openStream(peerId, EXPERTS_PROTOCOL, s)
        .then(stream => attach(peerId, stream), (err: unknown) => { throw lost(peerId, `cannot open a stream: ${(err as Error).message}`, err) })
        .finally(() => opening.delete(peerId))
      opening.set(peerId, p)
    }
    return await p
  }

  const link: ExpertLink = async (peerId, parts, signal) => {
    const l = await linkTo(peerId, signal)
    const payload = parts.length === 1 ? parts[0]! : new Uint8ArrayList(...parts).subarray()
    const step = peekStep(payload)!
    const answer = new Promise<Uint8Array>((resolve, reject) => {
      const onAbort = (): void => { l.pending.delete(step); reject(signal.reason) }
      signal.addEventListener('abort', onAbort, { once: true })
      l.pending.set(step, {
        resolve: (v) => { signal.removeEventListener('abort', onAbort); resolve(v) },
        reject: (e) => { signal.removeEventListener('abort', onAbort); reject(e) },
      })
    })
    try {
      await send(l.stream, payload, signal)
    } catch (err) {
      l.pending.get(step)?.reject(lost(peerId, `send failed: ${(err as Error).message}`, err))
    }
    return await answer
  }

  return {
    link,
    stop () { for (const l of links.values()) l.stream.abort(new Error('expert links stopping')); links.clear() },
    streams: () => links.size,
  }
}

/**
 * Links: the long-lived /shoal/stage/2.0.0 streams between a node and its chain neighbours. One
 * stream per peer pair carries every request in both directions (frames are multiplexed by
 * request id); it is opened on first use by whichever side sends first and reused by both.
 * Incoming bytes are split into varint-length-prefixed frames with a hard cap; a frame that cannot
 * be decoded is answered with a typed error frame, and one that breaks framing (too large, garbled
 * length) also resets the stream. When a stream ends, `onLinkDown` names the peer.
 *
 * (daemon/routing/frame-stream.ts does the same splitting but decodes /shoal/infer frames only; a
 * decoder parameter there would let this file drop its reader.)
 */
import type { Connection, Stream, StreamMessageEvent } from '@libp2p/interface'
import { Uint8ArrayList } from 'uint8arraylist'
import { serializeError } from '../errors.ts'
import { createDelayLine } from './delay.ts'
import { StageLostError, StageWireError } from './errors.ts'
import { decodePayload, encodeFrameParts, MAX_FRAME_BYTES, peekRequestId, STAGE_PROTOCOL } from './wire.ts'
import type { StageFrame } from './wire.ts'

export interface LinkComponents {
  /** This node's peer id. */
  peerId: string
  /** Registers the protocol handler (the mesh's admission-enforcing `handle`). */
  handle (protocol: string, handler: (stream: Stream, connection: Connection) => void | Promise<void>): Promise<void>
  unhandle? (protocol: string): Promise<void>
  /** Opens a stream to a peer (the mesh's `openStream`). */
  openStream (peerId: string, protocol: string, signal: AbortSignal): Promise<Stream>
}

export interface LinkOptions {
  maxFrameBytes?: number
  /** Simulated one-way latency added to every received frame (tests, benchmarks). */
  delayMs?: number
  /** Simulated cap on this node's incoming bandwidth, Mbit/s (tests, benchmarks; delay.ts). */
  bandwidthMbps?: number
  /** Longest wait to open a stream. */
  openTimeoutMs?: number
}

export type FrameHandler = (frame: StageFrame, fromPeer: string) => void

export interface Links {
  start (): Promise<void>
  stop (): Promise<void>
  /** Sends a frame to a peer, opening the link first when there is none. */
  send (peerId: string, frame: StageFrame, signal: AbortSignal): Promise<void>
  onFrame (handler: FrameHandler): void
  onLinkDown (handler: (peerId: string) => void): void
  /** Open streams (for leak checks). */
  streams (): number
  /** Frame bytes sent and received (length prefixes included) since start. */
  bytes (): { sent: number, received: number }
}

const MAX_VARINT_BYTES = 5

interface Link {
  peerId: string
  stream: Stream
  /** Set while the stream's send buffer is full. */
  drain: Promise<void> | undefined
}

export function createLinks (components: LinkComponents, options: LinkOptions = {}): Links {
  const maxFrameBytes = options.maxFrameBytes ?? MAX_FRAME_BYTES
  const delay = createDelayLine({ ms: options.delayMs ?? 0, ...(options.bandwidthMbps === undefined ? {} : { mbps: options.bandwidthMbps }) })
  let bytesSent = 0
  let bytesReceived = 0
  const links = new Map<string, Link[]>()
  const opening = new Map<string, Promise<Link>>()
  const frameHandlers: FrameHandler[] = []
  const downHandlers: Array<(peerId: string) => void> = []
  let running = false

  const dispatch = (frame: StageFrame, from: string): void => { for (const h of frameHandlers) h(frame, from) }

  function linkOf (peerId: string): Link | undefined {
    return links.get(peerId)?.find(l => l.stream.status === 'open' && l.stream.writeStatus === 'writable')
  }

  async function write (link: Link, frame: StageFrame, signal: AbortSignal): Promise<void> {
    const parts = encodeFrameParts(frame, maxFrameBytes)
    while (link.drain !== undefined) await link.drain
    signal.throwIfAborted()
    const list = new Uint8ArrayList(...parts)
    bytesSent += list.byteLength
    if (!link.stream.send(list)) {
      const d = link.stream.onDrain({ signal: AbortSignal.any([signal, AbortSignal.timeout(30_000)]) })
      link.drain = d.then(() => {}, () => {}).finally(() => { link.drain = undefined })
      await d
    }
  }

  /** Sends a typed error back on a link (best effort, never waits for drain). */
  function refuse (link: Link, requestId: string, err: unknown): void {
    try {
      if (link.stream.writeStatus === 'writable') link.stream.send(new Uint8ArrayList(...encodeFrameParts({ kind: 'error', requestId, error: serializeError(err) }, maxFrameBytes)))
    } catch { /* the stream broke: the peer sees that instead */ }
  }

  function attach (peerId: string, stream: Stream): Link {
    const link: Link = { peerId, stream, drain: undefined }
    links.set(peerId, [...(links.get(peerId) ?? []), link])
    const buf = new Uint8ArrayList()
    let broken = false

    const fatal = (err: StageWireError): void => {
      broken = true
      refuse(link, '', err)
      // Let the error frame leave before the reset.
      setTimeout(() => stream.abort(err), 50)
    }

    const onMessage = (evt: StreamMessageEvent): void => {
      if (broken) return
      buf.append(evt.data)
      while (buf.byteLength > 0) {
        let len = 0
        let scale = 1
        let i = 0
        for (; i < buf.byteLength; i++) {
          if (i >= MAX_VARINT_BYTES) { fatal(new StageWireError('SHOAL_ERR_STAGE_TOO_LARGE', 'frame length prefix is too long')); return }
          const b = buf.get(i)
          len += (b & 0x7f) * scale
          if ((b & 0x80) === 0) break
          scale *= 128
        }
        if (i === buf.byteLength) return
        if (len > maxFrameBytes) { fatal(new StageWireError('SHOAL_ERR_STAGE_TOO_LARGE', `incoming frame of ${len} bytes exceeds the ${maxFrameBytes}-byte cap`)); return }
        if (buf.byteLength < i + 1 + len) return
        const payload = buf.subarray(i + 1, i + 1 + len)
        buf.consume(i + 1 + len)
        let frame: StageFrame
        try {
          frame = decodePayload(payload)
        } catch (err) {
          // The frame's bounds are known, so the link survives: answer and go on.
          refuse(link, peekRequestId(payload) ?? '', err)
          continue
        }
        bytesReceived += i + 1 + len
        delay.push(() => dispatch(frame, peerId), i + 1 + len)
      }
    }
    const onClose = (): void => {
      stream.removeEventListener('message', onMessage)
      const rest = (links.get(peerId) ?? []).filter(l => l !== link)
      if (rest.length > 0) links.set(peerId, rest)
      else links.delete(peerId)
      if (!broken && buf.byteLength > 0) broken = true // ended inside a frame: nothing to answer on
      if (running) for (const h of downHandlers) h(peerId)
    }
    stream.addEventListener('message', onMessage)
    stream.addEventListener('close', onClose, { once: true })
    // The remote closing its write side means it is done with this link.
    stream.addEventListener('remoteCloseWrite', () => { if (stream.status === 'open') stream.close().catch(() => stream.abort(new Error('close failed'))) }, { once: true })
    return link
  }

  async function linkTo (peerId: string, signal: AbortSignal): Promise<Link> {
    const have = linkOf(peerId)
    if (have !== undefined) return have
    let p = opening.get(peerId)
    if (p === undefined) {
      const s = AbortSignal.any([signal, AbortSignal.timeout(options.openTimeoutMs ?? 10_000)])
      p = components.openStream(peerId, STAGE_PROTOCOL, s).then(stream => {
        if (!running) { stream.abort(new Error('links stopped')); throw new StageLostError('links are stopped', peerId) }
        return attach(peerId, stream)
      }, (err: unknown) => {
        throw new StageLostError(`cannot open a stage link to ${peerId}: ${(err as Error).message}`, peerId, { cause: err })
      }).finally(() => opening.delete(peerId))
      opening.set(peerId, p)
    }
    return await p
  }

  return {
    async start () {
      running = true
      await components.handle(STAGE_PROTOCOL, (stream, connection) => {
        if (!running) { stream.abort(new Error('links stopped')); return }
        attach(connection.remotePeer.toString(), stream)
      })
    },
    async stop () {
      running = false
      delay.clear()
      await components.unhandle?.(STAGE_PROTOCOL).catch(() => {})
      for (const l of [...links.values()].flat()) l.stream.abort(new StageLostError('the node is stopping'))
      links.clear()
    },
    async send (peerId, frame, signal) {
      if (!running) throw new StageLostError('links are stopped', peerId)
      const link = await linkTo(peerId, signal)
      try {
        await write(link, frame, signal)
      } catch (err) {
        if (signal.aborted) throw err
        if ((err as { code?: unknown }).code === 'SHOAL_ERR_STAGE_TOO_LARGE' || (err as { code?: unknown }).code === 'SHOAL_ERR_STAGE_MALFORMED') throw err
        throw new StageLostError(`the stage link to ${peerId} broke: ${(err as Error).message}`, peerId, { cause: err })
      }
    },
    onFrame (handler) { frameHandlers.push(handler) },
    onLinkDown (handler) { downHandlers.push(handler) },
    streams () { return [...links.values()].reduce((n, l) => n + l.length, 0) },
    bytes () { return { sent: bytesSent, received: bytesReceived } },
  }
}

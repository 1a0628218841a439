/**
 * Frames over a libp2p 3.x Stream (a message stream with events, not a duplex iterable): a reader
 * that buffers at most about one frame cap before pausing the stream, and a writer that waits for
 * drain. Both are cancelled by an AbortSignal and never wait without one.
 */
import type { Stream, StreamCloseEvent, StreamMessageEvent } from '@libp2p/interface'
import { Uint8ArrayList } from 'uint8arraylist'
import { InferWireError } from './errors.ts'
import { decodePayload, encodeFrame, MAX_FRAME_BYTES } from './wire.ts'
import type { InferFrame } from './wire.ts'

export interface FrameReader {
  /**
   * The next frame; null when the remote closed its side cleanly between frames. Rejects with
   * `signal.reason` when the signal aborts first, with an InferWireError on bad bytes, or with the
   * stream's error when it was reset.
   */
  next(signal: AbortSignal): Promise<InferFrame | null>
  /** Detaches from the stream. */
  dispose(): void
}

const MAX_LENGTH_BYTES = 8

export function createFrameReader (stream: Stream, maxFrameBytes: number = MAX_FRAME_BYTES): FrameReader {
  const buf = new Uint8ArrayList()
  const payloads: Uint8Array[] = []
  let queuedBytes = 0
  let paused = false
  let ended = stream.readableEnded
  let failure: unknown = stream.status === 'reset' || stream.status === 'aborted' ? new Error(`stream is ${stream.status}`) : undefined
  let notify: (() => void) | undefined

  const wake = (): void => {
    const n = notify
    notify = undefined
    n?.()
  }

  /** Moves every complete frame from `buf` into `payloads`. */
  const split = (): void => {
    while (buf.byteLength > 0) {
      let len = 0
      let scale = 1
      let i = 0
      for (; i < buf.byteLength; i++) {
        if (i >= MAX_LENGTH_BYTES) throw new InferWireError('SHOAL_ERR_INFER_TOO_LARGE', 'frame length prefix is too long')
        const b = buf.get(i)
        len += (b & 0x7f) * scale
        if ((b & 0x80) === 0) break
        scale *= 128
      }
      if (i === buf.byteLength) return // the length itself is still incomplete
      if (len > maxFrameBytes) throw new InferWireError('SHOAL_ERR_INFER_TOO_LARGE', `incoming frame of ${len} bytes exceeds the ${maxFrameBytes}-byte cap`)
      const start = i + 1
      if (buf.byteLength < start + len) return
      payloads.push(buf.subarray(start, start + len))
      queuedBytes += len
      buf.consume(start + len)
    }
  }

  const onMessage = (evt: StreamMessageEvent): void => {
    buf.append(evt.data)
    try {
      split()
    } catch (err) {
      failure ??= err
      stream.abort(err as Error)
    }
    // Bound what we hold for a slow consumer: pause the stream (its own buffer is capped too).
    if (!paused && queuedBytes + buf.byteLength > maxFrameBytes && stream.readStatus === 'readable') {
      try { stream.pause(); paused = true } catch { /* closing: nothing more will come */ }
    }
    wake()
  }
  const onEnd = (): void => { ended = true; wake() }
  const onClose = (evt: StreamCloseEvent): void => {
    if (evt.error !== undefined) failure ??= evt.error
    ended = true
    wake()
  }
  stream.addEventListener('message', onMessage)
  stream.addEventListener('end', onEnd)
  stream.addEventListener('close', onClose)

  return {
    async next (signal) {
      while (true) {
        const payload = payloads.shift()
        if (payload !== undefined) {
          queuedBytes -= payload.length
          if (paused && queuedBytes <= maxFrameBytes / 2) {
            paused = false
            try { stream.resume() } catch { /* closing */ }
          }
          return decodePayload(payload)
        }
        if (failure !== undefined) throw failure
        if (ended) {
          if (buf.byteLength > 0) throw new InferWireError('SHOAL_ERR_INFER_TRUNCATED', `stream ended inside a frame (${buf.byteLength} bytes left)`)
          return null
        }
        signal.throwIfAborted()
        await new Promise<void>((resolve, reject) => {
          const onAbort = (): void => { notify = undefined; reject(signal.reason) }
          signal.addEventListener('abort', onAbort, { once: true })
          notify = () => { signal.removeEventListener('abort', onAbort); resolve() }
        })
      }
    },
    dispose () {
      stream.removeEventListener('message', onMessage)
      stream.removeEventListener('end', onEnd)
      stream.removeEventListener('close', onClose)
    },
  }
}

/** Sends one frame, waiting for the stream to drain when its buffer is full. */
export async function writeFrame (stream: Stream, frame: InferFrame, signal: AbortSignal, maxFrameBytes: number = MAX_FRAME_BYTES): Promise<void> {
  signal.throwIfAborted()
  const bytes = encodeFrame(frame, maxFrameBytes)
  if (!stream.send(bytes)) await stream.onDrain({ signal })
}


/**
 * /shoal/kv/1.0.0 over libp2p streams (wire.ts), one stream per pull.
 *
 * Holder (serveKv): answers a pull for a model it serves with the longest prefix it keeps — only
 * to a peer `authorize` lets through (the mesh's `handle` admits only admitted peers already),
 * only for the same manifest, layer range and dtype (else SHOAL_ERR_KV_WRONG_MODEL). A
 * `pull-kept` (a chain stage's) names the coordinator's key instead of looking tokens up.
 *
 * Puller (createKvPuller): asks, checks everything (each frame's crc32 and structure, the header
 * against its own scope and shapes, the block hashes recomputed from its own token ids, chunk
 * order and counts) and only then hands the KV to its store. Every refusal, mismatch, timeout or
 * broken stream is an outcome `{ ok: false }`, never an exception: the caller recomputes.
 */
import { randomUUID } from 'node:crypto'
import type { Connection, Stream, StreamCloseEvent, StreamMessageEvent } from '@libp2p/interface'
import { Uint8ArrayList } from 'uint8arraylist'
import { serializeError } from '../errors.ts'
import { KvRefusedError, KvWireError } from './errors.ts'
import { DEFAULT_BLOCK_SIZE, exactPrefixHashes, prefixScope } from './hash.ts'
import type { KvStore, PullOutcome } from './store.ts'
import {
  createFrameSplitter, createPrefixReceiver, decodePayload, DEFAULT_MAX_CHUNK_BYTES, encodeFrameParts, KV_PROTOCOL, MAX_FRAME_BYTES, transferFrames,
} from './wire.ts'
import type { KvFrame, ReceivedPrefix } from './wire.ts'

export interface KvTransportComponents {
  /** Registers the protocol handler (the mesh's admission-enforcing `handle`). */
  handle (protocol: string, handler: (stream: Stream, connection: Connection) => void | Promise<void>): Promise<void>
  unhandle? (protocol: string): Promise<void>
  /** Opens a stream to a peer (the mesh's `openStream`, which refuses peers not admitted). */
  openStream (peerId: string, protocol: string, signal: AbortSignal): Promise<Stream>
}

export interface ServeKvInit {
  /** The stores of the models this node serves (asked per pull: models come and go). */
  stores (): readonly KvStore[]
  /** Why `from` may not pull from this node, or undefined; answered as an error frame. */
  authorize? (from: string): Error | undefined
  /** Longest wait for the pull frame after a stream opens. */
  requestTimeoutMs?: number
  /** Longest wait for the puller to take the whole transfer. */
  sendTimeoutMs?: number
  maxFrameBytes?: number
}

export const DEFAULT_REQUEST_TIMEOUT_MS = 10_000
export const DEFAULT_SEND_TIMEOUT_MS = 30_000

/** Sends one frame, waiting for the stream to drain when its buffer is full. */
async function send (stream: Stream, frame: KvFrame, signal: AbortSignal, maxFrameBytes: number): Promise<void> {
  signal.throwIfAborted()
  if (!stream.send(new Uint8ArrayList(...encodeFrameParts(frame, maxFrameBytes)))) await stream.onDrain({ signal })
}

/**
 * Frames as they arrive on a stream, handed to `onFrame` synchronously (decoded; a bad one throws
 * out of the listener into `onError`). Resolves `ended` when the remote closes, rejects on reset.
 */
function readFrames (stream: Stream, maxFrameBytes: number, onFrame: (f: KvFrame) => void): { done: Promise<void>, dispose (): void } {
  const split = createFrameSplitter(maxFrameBytes)
  let settle: { resolve: () => void, reject: (e: unknown) => void } | undefined
  const done = new Promise<void>((resolve, reject) => { settle = { resolve, reject } })
  const onMessage = (evt: StreamMessageEvent): void => {
    try {
      for (const p of split.push(evt.data instanceof Uint8Array ? evt.data : evt.data.subarray())) onFrame(decodePayload(p))
    } catch (err) {
      settle?.reject(err)
    }
  }
  const onEnd = (): void => {
    if (split.buffered() > 0) settle?.reject(new KvWireError('SHOAL_ERR_KV_TRUNCATED', `stream ended inside a frame (${split.buffered()} bytes left)`))
    else settle?.resolve()
  }
  const onClose = (evt: StreamCloseEvent): void => {
    if (evt.error !== undefined) settle?.reject(evt.error)
    else onEnd()
  }
  stream.addEventListener('message', onMessage)
  stream.addEventListener('end', onEnd)
  stream.addEventListener('close', onClose)
  if (stream.readableEnded) onEnd()
  done.catch(() => {})
  return {
    done,
    dispose () {
      stream.removeEventListener('message', onMessage)
      stream.removeEventListener('end', onEnd)
      stream.removeEventListener('close', onClose)
    },
  }
}

/** Waits for `p` or the signal. */
async function bounded<T> (p: Promise<T>, signal: AbortSignal): Promise<T> {
  p.catch(() => {})
  signal.throwIfAborted()
  let off = (): void => {}
  try {
    return await Promise.race([p, new Promise<never>((_resolve, reject) => {
      const onAbort = (): void => { reject(signal.reason) }
      signal.addEventListener('abort', onAbort, { once: true })
      off = () => { signal.removeEventListener('abort', onAbort) }
    })])
  } finally {
    off()
  }
}

/** Serves /shoal/kv/1.0.0 until stop(). */
export async function serveKv (init: ServeKvInit, components: KvTransportComponents): Promise<{ stop: () => Promise<void> }> {
  const maxFrameBytes = init.maxFrameBytes ?? MAX_FRAME_BYTES
  const streams = new Set<Stream>()
  const stopping = new AbortController()

  async function serve (stream: Stream, from: string): Promise<void> {
    let requestId: string | undefined
    let pull: Extract<KvFrame, { kind: 'pull' | 'pull-kept' }> | undefined
    let first!: { resolve: () => void }
    const arrived = new Promise<void>((resolve) => { first = { resolve } })
    const reader = readFrames(stream, maxFrameBytes, (f) => {
      if (pull !== undefined) throw new KvWireError('SHOAL_ERR_KV_UNEXPECTED_FRAME', `a ${f.kind} frame after the pull`)
      if (f.kind !== 'pull' && f.kind !== 'pull-kept') throw new KvWireError('SHOAL_ERR_KV_UNEXPECTED_FRAME', `expected a pull frame, got ${f.kind}`)
      pull = f
      requestId = f.requestId
      first.resolve()
    })
    const sendSignal = AbortSignal.any([stopping.signal, AbortSignal.timeout(init.sendTimeoutMs ?? DEFAULT_SEND_TIMEOUT_MS)])
    try {
      await bounded(Promise.race([arrived, reader.done.then(() => { throw new KvWireError('SHOAL_ERR_KV_TRUNCATED', 'stream ended before a pull frame') })]),
        AbortSignal.any([stopping.signal, AbortSignal.timeout(init.requestTimeoutMs ?? DEFAULT_REQUEST_TIMEOUT_MS)]))
      const p = pull!
      const refuse = (code: 'SHOAL_ERR_KV_NOT_HELD' | 'SHOAL_ERR_KV_WRONG_MODEL' | 'SHOAL_ERR_KV_REFUSED', message: string): never => { throw new KvRefusedError(code, message) }
      const denied = init.authorize?.(from)
      if (denied !== undefined) refuse('SHOAL_ERR_KV_REFUSED', `peer ${from} may not pull KV from this node: ${denied.message}`)
      // One node may keep KV of several layer ranges of one model (a whole model and a stage, or
      // two stages): the store is the one whose scope is the pull's, whole.
      const ofModel = init.stores().filter(s => s.info().manifestHash === p.manifestHash)
      if (ofModel.length === 0) refuse('SHOAL_ERR_KV_WRONG_MODEL', `this node serves no model with manifest ${p.manifestHash}`)
      const store = ofModel.find(s => { const i = s.info(); return i.layers[0] === p.layers[0] && i.layers[1] === p.layers[1] && i.dtype === p.dtype })
      if (store === undefined) {
        refuse('SHOAL_ERR_KV_WRONG_MODEL', `this node keeps layers ${ofModel.map(s => `${s.info().layers[0]}-${s.info().layers[1]} ${s.info().dtype}`).join(', ')} of ${p.manifestHash}, not ${p.layers[0]}-${p.layers[1]} ${p.dtype}`)
      }
      const info = store!.info()
      if (p.maxChunkBytes < 4) throw new KvWireError('SHOAL_ERR_KV_MALFORMED', `a chunk of at most ${p.maxChunkBytes} bytes cannot carry one value`)
      if (p.kind === 'pull-kept' && store!.exportKept === undefined) refuse('SHOAL_ERR_KV_NOT_HELD', 'this node keeps no prefixes by key for these layers')
      const exported = p.kind === 'pull-kept'
        ? await store!.exportKept!(p.key, p.owner, p.tokens.length, sendSignal)
        : await store!.exportPrefix(p.tokens, sendSignal)
      if (exported === undefined) refuse('SHOAL_ERR_KV_NOT_HELD', `no prefix of these ${p.tokens.length} tokens is kept here`)
      const { tokens, layers } = exported!
      if (tokens < 1 || tokens > p.tokens.length) refuse('SHOAL_ERR_KV_NOT_HELD', `the kept prefix has ${tokens} positions; 1-${p.tokens.length} were asked for`)
      const scope = prefixScope({ manifestHash: info.manifestHash, layers: [info.layers[0], info.layers[1]], dtype: info.dtype })
      for (const frame of transferFrames({
        requestId: p.requestId,
        manifestHash: info.manifestHash,
        layers: info.layers,
        dtype: info.dtype,
        tokens,
        numKvHeads: info.numKvHeads,
        headDim: info.headDim,
        blockSize: p.blockSize,
        hashes: exactPrefixHashes(scope, p.tokens.slice(0, tokens), p.blockSize),
        tensors: layers,
        maxChunkBytes: p.maxChunkBytes,
      })) {
        await send(stream, frame, sendSignal, maxFrameBytes)
      }
    } catch (err) {
      if (requestId !== undefined && stream.writeStatus === 'writable') {
        await send(stream, { kind: 'error', requestId, error: serializeError(err) }, AbortSignal.timeout(5_000), maxFrameBytes).catch(() => {})
      } else {
        // No request id to answer to (a bad first frame, or none in time): reset.
        stream.abort(err instanceof Error ? err : new Error(String(err)))
      }
    } finally {
      reader.dispose()
      if (stream.status === 'open') await stream.close({ signal: AbortSignal.timeout(5_000) }).catch((err: Error) => { stream.abort(err) })
    }
  }

  await components.handle(KV_PROTOCOL, (stream, connection) => {
    streams.add(stream)
    void serve(stream, connection.remotePeer.toString()).finally(() => streams.delete(stream))
  })
  return {
    async stop () {
      stopping.abort(new Error('kv holder stopping'))
      await components.unhandle?.(KV_PROTOCOL).catch(() => {})
      for (const s of streams) s.abort(new Error('kv holder stopping'))
      streams.clear()
    },
  }
}

export interface KvPullerInit {
  /** Tensor bytes per chunk to ask for (default DEFAULT_MAX_CHUNK_BYTES). */
  maxChunkBytes?: number
  /** Tokens per hashed block in the header's hashes (default DEFAULT_BLOCK_SIZE). */
  blockSize?: number
  /** Longest a pull may take, on top of the caller's signal (default DEFAULT_PULL_TIMEOUT_MS). */
  timeoutMs?: number
  maxFrameBytes?: number
}

export interface KvPullerComponents {
  openStream: KvTransportComponents['openStream']
  /** The store of a served model (by model id); undefined: not served here. */
  store (model: string): KvStore | undefined
}

export interface PullRequest {
  peerId: string
  model: string
  /** The prompt's token ids that may come from the holder (its longest kept prefix of them comes). */
  tokens: readonly number[]
  signal: AbortSignal
  /**
   * A chain stage's pull: the holder's prefix kept under `key` for coordinator `owner` (whose
   * first positions `tokens` are), imported here under the same key and owner (KvStore.importKept).
   */
  kept?: { key: string, owner: string }
}

export interface KvPuller {
  pull (request: PullRequest): Promise<PullOutcome>
}

export const DEFAULT_PULL_TIMEOUT_MS = 10_000

export function createKvPuller (init: KvPullerInit, components: KvPullerComponents): KvPuller {
  const maxFrameBytes = init.maxFrameBytes ?? MAX_FRAME_BYTES
  const maxChunkBytes = Math.min(init.maxChunkBytes ?? DEFAULT_MAX_CHUNK_BYTES, maxFrameBytes - 1024)
  const blockSize = init.blockSize ?? DEFAULT_BLOCK_SIZE
  return {
    async pull ({ peerId, model, tokens, signal, kept: byKey }) {
      const began = performance.now()
      const fallback = (err: unknown): PullOutcome => {
        const code = (err as { code?: unknown } | null)?.code
        // A DOMException's code is a number: an AbortSignal.timeout reason, from the caller's bound or ours.
        const timedOut = (err as { name?: unknown } | null)?.name === 'TimeoutError'
        return {
          ok: false,
          code: typeof code === 'string' ? code : timedOut ? 'SHOAL_ERR_KV_TIMEOUT' : 'SHOAL_ERR_INTERNAL',
          reason: err instanceof Error ? err.message : String(err),
        }
      }
      const store = components.store(model)
      if (store === undefined) return fallback(new KvRefusedError('SHOAL_ERR_KV_WRONG_MODEL', `model ${model} keeps no prefixes here`))
      if (tokens.length === 0) return fallback(new KvRefusedError('SHOAL_ERR_KV_NOT_HELD', 'no tokens to pull'))
      if (byKey !== undefined && store.importKept === undefined) return fallback(new KvRefusedError('SHOAL_ERR_KV_WRONG_MODEL', `model ${model} keeps no prefixes by key here`))
      const s = AbortSignal.any([signal, AbortSignal.timeout(init.timeoutMs ?? DEFAULT_PULL_TIMEOUT_MS)])
      let stream: Stream | undefined
      let reader: ReturnType<typeof readFrames> | undefined
      try {
        const info = store.info()
        const requestId = randomUUID()
        const rx = createPrefixReceiver({
          requestId, manifestHash: info.manifestHash, layers: info.layers, dtype: info.dtype,
          numKvHeads: info.numKvHeads, headDim: info.headDim, blockSize, tokens, maxChunkBytes,
        })
        const opened = components.openStream(peerId, KV_PROTOCOL, s)
        // An opener that ignores the signal must not leak the stream it opens late.
        opened.then(st => { if (s.aborted && stream === undefined) st.abort(new Error('pull aborted')) }, () => {})
        stream = await bounded(opened, s)
        let received: ReceivedPrefix | undefined
        let complete!: () => void
        const whole = new Promise<void>((resolve) => { complete = resolve })
        reader = readFrames(stream, maxFrameBytes, (f) => {
          const r = rx.accept(f)
          if (r !== undefined) { received = r; complete() }
        })
        const asked = { requestId, manifestHash: info.manifestHash, layers: info.layers, dtype: info.dtype, blockSize, maxChunkBytes, tokens }
        await send(stream, byKey === undefined ? { kind: 'pull', ...asked } : { kind: 'pull-kept', ...asked, key: byKey.key, owner: byKey.owner }, s, maxFrameBytes)
        // Done at the end frame; a stream that ends first is a truncation (rx.finish says so).
        await bounded(Promise.race([whole, reader.done.then(() => { rx.finish() })]), s)
        const got = received ?? rx.finish()
        reader.dispose()
        reader = undefined
        void stream.close({ signal: AbortSignal.timeout(5_000) }).catch((err: Error) => { stream?.abort(err) })
        // Checked end to end: now it may become this node's KV.
        const kept = byKey === undefined
          ? await store.importPrefix(tokens.slice(0, got.tokens), got.tensors, s)
          : await store.importKept!(byKey.key, byKey.owner, tokens.slice(0, got.tokens), got.tensors, s)
        if (!kept.kept) return fallback(new KvRefusedError('SHOAL_ERR_KV_NOT_HELD', 'the pulled prefix did not fit this node\'s prefix budget'))
        return { ok: true, tokens: got.tokens, bytes: got.bytes, ms: performance.now() - began }
      } catch (err) {
        stream?.abort(err instanceof Error ? err : new Error(String(err)))
        return fallback(s.aborted && !signal.aborted ? new KvWireError('SHOAL_ERR_KV_TIMEOUT', `pull from ${peerId} took over ${init.timeoutMs ?? DEFAULT_PULL_TIMEOUT_MS} ms`) : err)
      } finally {
        reader?.dispose()
      }
    },
  }
}

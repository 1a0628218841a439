/**
 * Length-prefixed frames over a libp2p stream (@libp2p/utils' lpStream), with the package loaded
 * when a stream first needs it: it and what it imports are ~90 modules, ~60 ms of every start,
 * that a daemon without a mesh (`shoal serve`) never uses (test/node/lazy-mesh.test.ts).
 */
import type { Stream } from '@libp2p/interface'
import type { lpStream } from '@libp2p/utils'

export type LengthPrefixed = ReturnType<typeof lpStream<Stream>>

/** `stream` read and written as frames of at most `maxDataLength` bytes. */
export async function lengthPrefixed (stream: Stream, maxDataLength: number): Promise<LengthPrefixed> {
  const { lpStream } = await import('@libp2p/utils')
  return lpStream(stream, { maxDataLength })
}

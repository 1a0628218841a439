/** Errors in stage error frames, both ways: the lost peer's id travels beside the code. */
import { deserializeError, serializeError } from '../errors.ts'
import type { SerializedError } from '../errors.ts'
import { StageLostError } from './errors.ts'

/** An error for an error frame: the code, plus the lost peer's id when there is one. */
export function errorBody (err: unknown): SerializedError & { peerId?: string } {
  const peerId = err instanceof StageLostError ? err.peerId : undefined
  return peerId === undefined ? serializeError(err) : { ...serializeError(err), peerId }
}

/** An error frame from a peer, as an Error with the peer's name and code. */
export function remoteError (e: SerializedError & { peerId?: string }): Error {
  if (e.code === 'SHOAL_ERR_PEER_LOST') return new StageLostError(e.message, e.peerId)
  return deserializeError(e)
}

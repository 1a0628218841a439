/**
 * Typed errors of the mesh. Wire problems are `WireError`s whose `code` is what travels in an
 * error frame; callers compare `code`, never message text.
 */
import { ShoalError, WireFormatError } from '../errors.ts'

/** Codes that may appear in a wire error frame (`{"type":"error","code":…}`). */
export type WireErrorCode =
  | 'SHOAL_ERR_MESH_MALFORMED'
  | 'SHOAL_ERR_MESH_TOO_LARGE'
  | 'SHOAL_ERR_MESH_UNSUPPORTED_VERSION'
  | 'SHOAL_ERR_MESH_UNEXPECTED_FRAME'
  | 'SHOAL_ERR_MESH_RATE_LIMITED'
  | 'SHOAL_ERR_MESH_REFUSED'
  | 'SHOAL_ERR_MESH_INTERNAL'

export const WIRE_ERROR_CODES: readonly WireErrorCode[] = Object.freeze([
  'SHOAL_ERR_MESH_MALFORMED', 'SHOAL_ERR_MESH_TOO_LARGE', 'SHOAL_ERR_MESH_UNSUPPORTED_VERSION',
  'SHOAL_ERR_MESH_UNEXPECTED_FRAME', 'SHOAL_ERR_MESH_RATE_LIMITED', 'SHOAL_ERR_MESH_REFUSED',
  'SHOAL_ERR_MESH_INTERNAL',
])

/** A frame that cannot be decoded, or an error frame received from the remote. */
export class WireError extends WireFormatError<WireErrorCode> {
  override name = 'WireError'
}

/** A stream was asked of / offered by a peer that is not (or no longer) admitted. */
export class PeerNotAdmittedError extends ShoalError {
  override name = 'PeerNotAdmittedError'
  constructor (peerId: string, why: string) {
    super('SHOAL_ERR_MESH_NOT_ADMITTED', `peer ${peerId} is not admitted: ${why}`)
  }
}

/** The mesh is not started, or is stopping. */
export class MeshNotRunningError extends ShoalError {
  override name = 'MeshNotRunningError'
  constructor () {
    super('SHOAL_ERR_MESH_NOT_RUNNING', 'the mesh is not running')
  }
}

/** Bad `createMesh` init (the key is named). */
export class MeshConfigError extends ShoalError {
  override name = 'MeshConfigError'
  constructor (key: string, message: string) {
    super('SHOAL_ERR_MESH_CONFIG', `mesh.${key}: ${message}`)
  }
}

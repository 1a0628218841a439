/**
 * Typed errors of pipeline chains. Callers compare `code`, never message text; codes travel in
 * error frames unchanged.
 */
import { ShoalError, WireFormatError } from '../errors.ts'

/** Codes of /shoal/stage wire violations; they also travel back in error frames. */
export type StageWireErrorCode =
  | 'SHOAL_ERR_STAGE_UNSUPPORTED_VERSION'
  | 'SHOAL_ERR_STAGE_UNKNOWN_KIND'
  | 'SHOAL_ERR_STAGE_TOO_LARGE'
  | 'SHOAL_ERR_STAGE_TRUNCATED'
  | 'SHOAL_ERR_STAGE_MALFORMED'
  | 'SHOAL_ERR_STAGE_UNKNOWN_REQUEST'
  | 'SHOAL_ERR_STAGE_MISMATCH'

/** A frame that cannot be decoded, or does not fit what this stage holds. */
export class StageWireError extends WireFormatError<StageWireErrorCode> {
  override name = 'StageWireError'
}

/** A stage of the chain went away (stream reset, node stopped, or silent past the idle timeout). */
export class StageLostError extends ShoalError {
  override name = 'StageLostError'
  readonly peerId: string | undefined
  constructor (message: string, peerId?: string, options?: ErrorOptions) {
    super('SHOAL_ERR_PEER_LOST', message, options)
    this.peerId = peerId
  }
}

/** The node's stage does not fit the request (wrong layers, wrong manifest, no head, …). */
export class StageConfigError extends ShoalError {
  override name = 'StageConfigError'
  constructor (message: string) {
    super('SHOAL_ERR_STAGE_CONFIG', message)
  }
}

/**
 * An open frame asked this stage to start from a kept prefix it no longer holds (evicted within
 * its budget, the node restarted, or another coordinator's key). The coordinator reopens the
 * request without the prefix: never reaches a client.
 */
export class StagePrefixGoneError extends ShoalError {
  override name = 'StagePrefixGoneError'
  constructor (message: string) {
    super('SHOAL_ERR_STAGE_PREFIX_GONE', message)
  }
}

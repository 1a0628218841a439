/**
 * Typed errors of expert holders. Callers compare `code`, never message text; codes travel in
 * /shoal/experts error frames unchanged.
 */
import { ShoalError, WireFormatError } from '../errors.ts'

/** Codes of /shoal/experts wire violations; they also travel back in error frames. */
export type ExpertWireErrorCode =
  | 'SHOAL_ERR_EXPERTS_UNSUPPORTED_VERSION'
  | 'SHOAL_ERR_EXPERTS_UNKNOWN_KIND'
  | 'SHOAL_ERR_EXPERTS_TOO_LARGE'
  | 'SHOAL_ERR_EXPERTS_TRUNCATED'
  | 'SHOAL_ERR_EXPERTS_MALFORMED'
  /** The holder does not hold an expert the frame names, or serves another model. */
  | 'SHOAL_ERR_EXPERTS_NOT_HELD'

/** A frame that cannot be decoded. */
export class ExpertWireError extends WireFormatError<ExpertWireErrorCode> {
  override name = 'ExpertWireError'
}

/**
 * A MoE step could not run: every holder of a chosen expert is gone. The request fails cleanly
 * (before its next token) and is replayed like a request whose chain stage died.
 */
export class ExpertsLostError extends ShoalError {
  override name = 'ExpertsLostError'
  readonly layer: number
  readonly expert: number
  constructor (layer: number, expert: number, holders: string[], options?: ErrorOptions) {
    super('SHOAL_ERR_PEER_LOST', `no live holder of expert ${expert} of layer ${layer} (held by ${holders.join(', ') || 'nobody'})`, options)
    this.layer = layer
    this.expert = expert
  }
}

/**
 * The holders the mesh offers cannot hold every expert of the model (or there are none): a
 * request fails before its first token (503), or mid-stream with an error event.
 */
export class ExpertsUnplaceableError extends ShoalError {
  override name = 'ExpertsUnplaceableError'
  constructor (message: string, options?: ErrorOptions) {
    super('SHOAL_ERR_EXPERTS_UNPLACEABLE', message, options)
  }
}

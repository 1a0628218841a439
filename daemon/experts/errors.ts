/**
 * Typed errors of expert holders. Callers compare `code`, never message text; codes travel in
 * /shoal/experts error frames unchanged.
 */
import { ShoalError } from '../errors.ts'

/** Codes of /shoal/experts wire violations; they also travel back in error frames. */
export type ExpertWireErrorCode =
  | 'SHOAL_ERR_EXPERTS_UNSUPPORTED_VERSION'
  | 'SHOAL_ERR_EXPERTS_UNKNOWN_KIND'
  | 'SHOAL_ERR_EXPERTS_TOO_LARGE'
  | 'SHOAL_ERR_EXPERTS_TRUNCATED'
  | 'SHOAL_ERR_EXPERTS_MALFORMED'

/** A frame that cannot be decoded. */
export class ExpertWireError extends ShoalError {
  override name = 'ExpertWireError'
  declare readonly code: ExpertWireErrorCode
  constructor (code: ExpertWireErrorCode, message: string, options?: ErrorOptions) {
    super(code, message, options)
  }
}

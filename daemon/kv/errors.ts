/**
 * Typed errors of KV mobility (/shoal/kv/1.0.0). Callers compare `code`, never message text;
 * codes travel in error frames unchanged. None of them reaches a client: every failure of a pull
 * ends in recomputation.
 */
import { ShoalError, WireFormatError } from '../errors.ts'

export type KvWireErrorCode =
  | 'SHOAL_ERR_KV_UNSUPPORTED_VERSION'
  | 'SHOAL_ERR_KV_UNKNOWN_KIND'
  | 'SHOAL_ERR_KV_TOO_LARGE'
  | 'SHOAL_ERR_KV_TRUNCATED'
  | 'SHOAL_ERR_KV_MALFORMED'
  /** A frame's crc32 does not match its bytes. */
  | 'SHOAL_ERR_KV_CHECKSUM'
  /** A frame out of order: another request's, a chunk not where the next one belongs, a second header. */
  | 'SHOAL_ERR_KV_UNEXPECTED_FRAME'
  /** The transfer disagrees with what the puller knows: block hashes, layer range, dtype or shapes. */
  | 'SHOAL_ERR_KV_MISMATCH'
  /** The pull did not finish within its time bound. */
  | 'SHOAL_ERR_KV_TIMEOUT'

export type KvRefusalCode =
  /** The holder keeps no prefix of those tokens (any more). */
  | 'SHOAL_ERR_KV_NOT_HELD'
  /** The holder serves no such model, or the same model with another manifest, layer range or dtype. */
  | 'SHOAL_ERR_KV_WRONG_MODEL'
  /** The asking peer may not pull from this node (not admitted, or its certificate's roles). */
  | 'SHOAL_ERR_KV_REFUSED'

/** A frame or a transfer that cannot be used. */
export class KvWireError extends WireFormatError<KvWireErrorCode> {
  override name = 'KvWireError'
}

/** The holder will not serve this pull. */
export class KvRefusedError extends ShoalError {
  override name = 'KvRefusedError'
  declare readonly code: KvRefusalCode
  constructor (code: KvRefusalCode, message: string) {
    super(code, message)
  }
}

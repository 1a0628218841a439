/** Typed errors of the witness module. */
import { WireFormatError } from '../errors.ts'

export type WitnessWireCode = 'SHOAL_ERR_WITNESS_MALFORMED' | 'SHOAL_ERR_WITNESS_UNSUPPORTED_VERSION'

/** A /shoal/heads frame that is not one this build reads. */
export class WitnessWireError extends WireFormatError<WitnessWireCode> {
  override name = 'WitnessWireError'
}

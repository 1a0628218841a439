/**
 * Errors raised while importing a checkpoint or compiling/reading shards. Each has a stable
 * SHOAL_ERR_* code so callers (CLI, daemon, engine worker) compare by `code`, never `instanceof`.
 */
import { ShoalError } from '../daemon/errors.ts'

/** The checkpoint names an architecture with no registered mapping. */
export class UnsupportedArchitectureError extends ShoalError {
  override name = 'UnsupportedArchitectureError'
  readonly architecture: string
  readonly supported: string[]
  constructor (architecture: string, supported: string[]) {
    super('SHOAL_ERR_UNSUPPORTED_ARCHITECTURE',
      `unsupported architecture "${architecture}"; supported: ${supported.join(', ')}`)
    this.architecture = architecture
    this.supported = supported
  }
}

/** A checkpoint directory is missing a file, has a malformed file, or a tensor is absent/misshaped. */
export class CheckpointError extends ShoalError {
  override name = 'CheckpointError'
  constructor (message: string, options?: ErrorOptions) {
    super('SHOAL_ERR_CHECKPOINT', message, options)
  }
}

/** --stages / --layers do not describe a partition of the model's layers. */
export class LayerSplitError extends ShoalError {
  override name = 'LayerSplitError'
  constructor (message: string) {
    super('SHOAL_ERR_LAYER_SPLIT', message)
  }
}

/** manifest.json is missing, malformed, or of another format version. */
export class ManifestError extends ShoalError {
  override name = 'ManifestError'
  constructor (message: string, options?: ErrorOptions) {
    super('SHOAL_ERR_MANIFEST', message, options)
  }
}

/** A shard file's size or sha256 differs from the manifest (tampered or truncated). */
export class ShardIntegrityError extends ShoalError {
  override name = 'ShardIntegrityError'
  readonly path: string
  constructor (path: string, message: string) {
    super('SHOAL_ERR_SHARD_INTEGRITY', `${path}: ${message}`)
    this.path = path
  }
}

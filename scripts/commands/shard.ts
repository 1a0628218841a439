import { ExitError } from '../exit-error.ts'

export async function shard (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('shard: not implemented yet')
}


import { ExitError } from '../exit-error.ts'

export async function node (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('node: not implemented yet')
}


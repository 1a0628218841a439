import { ExitError } from '../exit-error.ts'

export async function demo (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('demo: not implemented yet')
}


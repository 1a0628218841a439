import { ExitError } from '../exit-error.ts'

export async function doctor (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('doctor: not implemented yet')
}


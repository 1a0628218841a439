import { ExitError } from '../exit-error.ts'

export async function serve (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('serve: not implemented yet')
}


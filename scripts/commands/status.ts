import { ExitError } from '../exit-error.ts'

export async function status (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('status: not implemented yet')
}


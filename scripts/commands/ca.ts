import { ExitError } from '../exit-error.ts'

export async function caInit (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('ca: not implemented yet')
}

export async function caIssue (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('ca: not implemented yet')
}

export async function caRevoke (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('ca: not implemented yet')
}

export async function caList (_opts: Record<string, unknown>): Promise<void> {
  throw new ExitError('ca: not implemented yet')
}


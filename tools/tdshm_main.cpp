// placeholder: the tdshm command-line tool (demo) is being written
int main() { return 0; }

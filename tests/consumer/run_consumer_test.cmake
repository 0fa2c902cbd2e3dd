# placeholder: install-tree consumer test is being written
